"""The loader's configuration: frozen dataclasses grouped by concern, each checking itself.

``build_loader(source, manifest, split, config=None, **overrides)`` takes a ``LoaderConfig``
and/or the flat keywords it always took (``batch_size=``, ``device=``...), which land in the
group that owns them. A config is plain data: share one between train and val loaders, keep
it with an experiment, derive variants with ``config.replace(block_chunks=8)``.
Checks that need the store (world size against the split, the memory budget) happen in
``graph.resolve``; the ones here need nothing but the values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import ConfigError, ConfigTypeError, UnknownNameError
from .io.chunk_cache import ChunkCache
from .io.device_decode import FrameDecoder
from .io.retry import RetryPolicy
from .memory.budget import parse_bytes
from .sampling.schedule import UNEVEN_POLICIES
from .sampling.windows import SampleWindow, steps_keyword
from .store.splits import SplitManifest
from .store.statistics import SCHEMES, Stats

DEFAULT_RING_SIZE = 3  # pinned host buffers CUDA copies go through (PinOrCudaNode's too)


def _positive_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _flag(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{owner}.{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """Which samples, in what order, on which rank: batch size, shuffle window, seed, ranks.

    ``rank``/``world_size`` default to the initialised ``torch.distributed`` group (else
    0/1); ``uneven`` keeps ranks at equal step counts (``"pad"``, ``"drop"`` or ``"none"``).
    ``read_group=G``: ranks ``r // G`` form a model group dealt samples as one rank is
    without it (equal steps, ``uneven``, elastic resume: all by group), and rank ``r % G``
    reads its balanced part of the grid (``sampling/grid_parts.py``); G must divide the
    world size.
    """

    batch_size: int = 32
    block_chunks: int | None = None  # None: 16, or ~128 MB windows decoding in place
    # time steps: chunks per contiguous run (None: halos <= 25% of the reads); a window
    # holds block_chunks // run_chunks runs from scattered places in the split
    run_chunks: int | None = None
    seed: int = 0
    drop_last: bool = False
    uneven: str = "pad"
    rank: int | None = None
    world_size: int | None = None
    # anchors kept: every k-th step (an int), or a duration such as "6h" on a time axis
    # (the steps whose time is a multiple of it: 00, 06, 12, 18 UTC); None: every step
    every: int | str | None = None
    # ranks per model group (reader group): the group is dealt samples, each rank reads its
    # part of the grid; must divide the world size (checked with it, graph.resolve)
    read_group: int = 1

    def __post_init__(self) -> None:
        _positive_int("sampling", "batch_size", self.batch_size)
        _positive_int("sampling", "read_group", self.read_group)
        if self.every is not None and not isinstance(self.every, str):
            _positive_int("sampling", "every", self.every)
        if self.block_chunks is not None:
            _positive_int("sampling", "block_chunks", self.block_chunks)
        if self.run_chunks is not None:
            _positive_int("sampling", "run_chunks", self.run_chunks)
            if self.block_chunks is not None and self.run_chunks > self.block_chunks:
                raise ConfigError(f"sampling.run_chunks={self.run_chunks} exceeds block_chunks="
                                 f"{self.block_chunks}: a window holds whole runs")
        if self.uneven not in UNEVEN_POLICIES:
            raise ConfigError(f"sampling.uneven must be one of {UNEVEN_POLICIES}, "
                             f"got {self.uneven!r}")
        if isinstance(self.seed, np.integer):  # states are JSON: keep a Python int
            object.__setattr__(self, "seed", int(self.seed))
        _positive_int("sampling", "seed", self.seed, minimum=0)
        _flag("sampling", "drop_last", self.drop_last)
        # rank/world_size are checked together with the process group (permute.resolve_rank)


def _reads_as_bytes(value: int | str) -> bool:
    """Whether ``parse_bytes`` reads ``value`` (``"2GB"``, ``512 * 2**20``)."""
    try:
        parse_bytes(value)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class FetchConfig:
    """How windows are read: reads in flight, windows fetched ahead, decode threads and
    where decoding runs, the resident-memory budget and the retry policy.

    ``prefetch_windows=None`` means 2 (``defaults.default_prefetch_windows``: a round trip
    hidden at each window edge of an object store, a decode pool kept busy on a local disk),
    deepened with decode workers until they all have work (``defaults.resolve_prefetch``);
    ``decode_threads=None`` means cores + 1, at most 4, or as many as cores when decoding in
    place one sample per chunk (``defaults.default_decode_threads``).
    ``decode`` is ``"cpu"``, ``"gpu"`` or a ``FrameDecoder`` object (tests pass
    ``HostFrameDecoder``). ``in_place`` decodes every chunk straight into its batch rows
    (CPU decode, channels that take whole variables; time steps too): a chunk of one sample
    is a row; a chunk of several is decoded once on a decode thread and its samples copied
    into their rows there. ``None`` does it wherever it applies (several samples per chunk:
    on local files only), ``False`` never, ``True`` or an error saying why not.
    ``cache`` (a ``ChunkCache``) keeps the stored chunks of object stores and icechunk on
    local disk, so later epochs read them from there. ``prefetch_next_epoch`` fetches the
    next epoch's first windows while this one's last batches are drawn (its first batch
    then need not wait for a whole window); off, each ``iter()`` starts an empty pipeline.
    ``workers``: decode worker processes writing straight into batches in shared memory
    (in-place decoding; ``workers/``), 0 for the decode threads of the training process,
    ``"auto"`` for what measured fastest on this machine (``default_workers``).
    ``worker_timeout_s``: a decode worker running one job this long, holding jobs this
    long without taking one, or not ready max(this, 30 s) after its start is taken for
    hung, killed and started again, its jobs run again on the live workers.
    ``keep_decoded``: bytes of decoded stripes (chunks of several samples) kept across
    epochs, so each is decoded once and later epochs copy from memory; ``None`` keeps them
    where a split fits in one window on the decode threads (no memory beyond the window's),
    ``0`` never; a size is added to the resident bound (``defaults.resolve_keep_decoded``).
    """

    max_inflight: int = 32
    prefetch_windows: int | None = None
    decode_threads: int | None = None
    memory_budget: int | str | None = None
    retry: RetryPolicy | None = None
    decode: str | FrameDecoder = "cpu"
    in_place: bool | None = None
    cache: ChunkCache | None = None
    prefetch_next_epoch: bool = True
    workers: int | str = "auto"
    worker_timeout_s: float = 300.0
    keep_decoded: int | str | None = None

    def __post_init__(self) -> None:
        _positive_int("fetch", "max_inflight", self.max_inflight)
        k = self.keep_decoded
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, str))
                              or (isinstance(k, int) and k < 0) or not _reads_as_bytes(k)):
            raise ConfigError(f"fetch.keep_decoded must be None (keep where a split fits in "
                              f"one window), 0 (never) or a byte size such as '2GB', "
                              f"got {k!r}")
        t = self.worker_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ConfigError(f"fetch.worker_timeout_s must be a number of seconds > 0 (how "
                              f"long a decode worker may run one job before it is killed and "
                              f"its jobs run again), got {t!r}")
        if self.workers != "auto" and (isinstance(self.workers, bool)
                                       or not isinstance(self.workers, int) or self.workers < 0):
            raise ConfigError(f"fetch.workers must be 'auto' or an integer >= 0 (0: decode "
                             f"threads in this process), got {self.workers!r}")
        _flag("fetch", "prefetch_next_epoch", self.prefetch_next_epoch)
        if self.cache is not None and not isinstance(self.cache, ChunkCache):
            raise ConfigTypeError(f"fetch.cache must be an ib.ChunkCache(directory, "
                                  f"max_bytes=...), got {self.cache!r}")
        if self.prefetch_windows is not None:
            _positive_int("fetch", "prefetch_windows", self.prefetch_windows, minimum=0)
        if self.decode_threads is not None:
            _positive_int("fetch", "decode_threads", self.decode_threads)
        if isinstance(self.decode, str) and self.decode not in ("cpu", "gpu"):
            raise ConfigError(f"fetch.decode must be 'cpu' or 'gpu', got {self.decode!r} "
                             "(or pass a FrameDecoder object)")
        if self.in_place is not None and not isinstance(self.in_place, bool):  # 0 == False
            raise ConfigError(f"fetch.in_place must be None, True or False, got {self.in_place!r}")
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ConfigTypeError(f"fetch.retry must be a RetryPolicy, got {self.retry!r}")


@dataclass(frozen=True)
class SampleConfig:
    """What one batch row holds: a sample's time steps (``steps``, a ``SampleWindow``;
    ``window=`` is its deprecated old name), normalisation and cast, channels stacked,
    static fields, spatial patches."""

    steps: SampleWindow | None = None
    stats: Stats | None = None
    dtype: torch.dtype | None = None
    channels: tuple[str | tuple[str, Any], ...] | None = None
    static: Mapping[str, Any] | None = None
    patch_size: tuple[int, ...] | None = None
    patch_stride: tuple[int, ...] | None = None
    # {variable, anemoi label or "default": scheme}: how ``stats`` are applied
    normalize: Mapping[str, str] | None = None
    # the stacked channels (or an anemoi dataset's variables) on the last axis, as views
    channels_last: bool = False
    drop_ensemble: bool = False  # anemoi: drop the (single-member) ensemble axis
    # missing values (NaN, and any non-finite value) replaced by this after normalization
    fill_nan: float | None = None
    # True (every variable) or names: batch["mask/<key>"], bool, True where the value is valid
    mask: bool | tuple[str, ...] = False

    def __post_init__(self) -> None:
        if self.fill_nan is not None and (isinstance(self.fill_nan, bool)
                                          or not isinstance(self.fill_nan, (int, float))
                                          or not np.isfinite(self.fill_nan)):
            raise ConfigError(f"sample.fill_nan must be a finite number (0.0 is the usual "
                             f"choice after normalization) or None, got {self.fill_nan!r}")
        if not isinstance(self.mask, bool):
            if isinstance(self.mask, str) or not isinstance(self.mask, Sequence):
                raise ConfigTypeError(f"sample.mask must be True, False or a list of variable "
                                      f"names, got {self.mask!r}")
            object.__setattr__(self, "mask", tuple(self.mask))
        if self.normalize is not None:
            if not isinstance(self.normalize, Mapping):
                raise ConfigTypeError(f"sample.normalize must map names to schemes, got "
                                      f"{self.normalize!r}")
            bad = {k: v for k, v in self.normalize.items() if v not in SCHEMES}
            if bad:
                raise ConfigError(f"sample.normalize has unknown schemes {bad}; schemes: "
                                 f"{list(SCHEMES)}")
            if self.stats is None:
                raise ConfigError("sample.normalize needs stats= (e.g. ib.dataset_stats(src) "
                                 "or ib.compute_stats(...)) to apply its schemes to")
        if self.steps is not None and not isinstance(self.steps, SampleWindow):
            raise ConfigTypeError(f"sample.steps must be a SampleWindow, got {self.steps!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ConfigTypeError(f"sample.dtype must be a torch.dtype such as torch.bfloat16, "
                                  f"got {self.dtype!r}")
        for name in ("channels", "patch_size", "patch_stride"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                if isinstance(value, str) or not isinstance(value, Sequence):
                    raise ConfigTypeError(f"sample.{name} must be a sequence, got {value!r}")
                object.__setattr__(self, name, tuple(value))
        if self.patch_stride is not None and self.patch_size is None:
            raise ConfigError("sample.patch_stride needs patch_size")
        for name in ("patch_size", "patch_stride"):
            value = getattr(self, name)
            if value is not None and (not value or not all(
                    isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1
                    for n in value)):
                raise ConfigError(f"sample.{name} must be positive integers, one per patched "
                                 f"dim, got {value!r}")
        if (self.patch_stride is not None and self.patch_size is not None
                and len(self.patch_stride) != len(self.patch_size)):
            raise ConfigError(f"sample.patch_stride {self.patch_stride} and patch_size "
                             f"{self.patch_size} must have one entry per patched dim each")
        if self.static is not None:
            if not isinstance(self.static, Mapping):
                raise ConfigTypeError(f"sample.static must map names to arrays, as "
                                      f"ib.open_static(url) returns, got a "
                                      f"{type(self.static).__name__}: {repr(self.static)[:80]}")
            for name, value in self.static.items():
                numeric = (not value.dtype.is_complex if isinstance(value, torch.Tensor)
                           else np.asarray(value).dtype.kind in "biuf")
                if not isinstance(name, str) or not numeric:
                    raise ConfigTypeError(f"sample.static[{name!r}] must be a numeric array under "
                                          f"a string name (ib.open_static(url) returns such a "
                                          f"dict), got {type(value).__name__}")

    @property
    def time_steps(self) -> SampleWindow | None:
        """``steps``, or ``None`` when each sample is one step (nothing to window)."""
        if self.steps is None or self.steps.is_single_step:
            return None
        return self.steps


@dataclass(frozen=True)
class DeviceConfig:
    """Where batches end up: ``device`` (``None``/``"cpu"``: no copy) and, on CUDA, the
    number of reused pinned host buffers the copies go through."""

    device: str | torch.device | None = None
    ring_size: int = DEFAULT_RING_SIZE

    def __post_init__(self) -> None:
        _positive_int("device", "ring_size", self.ring_size)


@dataclass(frozen=True)
class CheckpointConfig:
    """What a training loop needs besides batches: states kept for trainers that read ahead
    (``keep_states``), whether a moved icechunk branch may be resumed on, stats logging.

    ``allow_state_change=True`` loads a state saved with another ``batch_size`` or
    ``drop_last``: sound, since states count windows and draws, not batches (the rest of the
    epoch is still served exactly once), except the batch size mid-epoch when decoding in
    place (batches planned from the epoch's start). Any other difference (manifest, split,
    seed, grid, ranks, ``block_chunks``, ``uneven``, time steps) is refused whatever this
    says.
    """

    keep_states: int = 0
    allow_snapshot_change: bool = False
    allow_state_change: bool = False
    log_every_s: float | None = None

    def __post_init__(self) -> None:
        _positive_int("checkpoint", "keep_states", self.keep_states, minimum=0)
        for name in ("allow_snapshot_change", "allow_state_change"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(f"checkpoint.{name} must be True or False, "
                                      f"got {getattr(self, name)!r}")
        if self.log_every_s is not None and not self.log_every_s > 0:
            raise ConfigError(f"checkpoint.log_every_s must be > 0 (or None), "
                             f"got {self.log_every_s!r}")


_GROUPS: dict[str, type] = {"sampling": SamplingConfig, "fetch": FetchConfig,
                            "sample": SampleConfig, "device": DeviceConfig,
                            "checkpoint": CheckpointConfig}


def _owner(key: str) -> tuple[str, str]:
    for group, cls in _GROUPS.items():
        if key in {f.name for f in dataclasses.fields(cls)}:
            return group, key
    known = sorted(f.name for c in _GROUPS.values() for f in dataclasses.fields(c))
    raise ConfigTypeError(f"build_loader got an unknown option {key!r}; options: "
                          f"{', '.join(known)}")


@dataclass(frozen=True)
class LoaderConfig:
    """Every option of ``build_loader``, by concern. ``LoaderConfig.of(batch_size=64)``
    builds one from flat keywords; ``replace`` derives a variant the same way."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        for name, cls in _GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigTypeError(f"LoaderConfig.{name} must be a {cls.__name__}, "
                                      f"got {getattr(self, name)!r}")

    @classmethod
    def of(cls, **options: Any) -> LoaderConfig:
        """A config from ``build_loader``'s flat keywords (unknown ones are a TypeError
        listing the known options)."""
        return cls().replace(**options)

    def replace(self, **options: Any) -> LoaderConfig:
        """This config with the given flat keywords (or whole groups) changed; ``window=``
        is the deprecated old name of ``steps=`` (a warning; both at once an error)."""
        if "window" in options:  # build_loader(window=) / SampleDataset: the caller's line
            window = options.pop("window")
            options["steps"] = steps_keyword(options.get("steps"), window, "build_loader",
                                             stacklevel=4)
        groups: dict[str, dict[str, Any]] = {}
        whole: dict[str, Any] = {}
        for key, value in options.items():
            # ``device=`` is both a group and its main option: a DeviceConfig is the group
            if key in _GROUPS and (key != "device" or isinstance(value, DeviceConfig)):
                whole[key] = value
                continue
            group, name = _owner(key)
            groups.setdefault(group, {})[name] = value
        out = dataclasses.replace(self, **whole) if whole else self
        changed = {g: dataclasses.replace(getattr(out, g), **kv) for g, kv in groups.items()}
        return dataclasses.replace(out, **changed) if changed else out

    def as_kwargs(self) -> dict[str, Any]:
        """The flat keywords that rebuild this config (``build_loader(..., **kwargs)``)."""
        out: dict[str, Any] = {}
        for group in _GROUPS:
            for f in dataclasses.fields(getattr(self, group)):
                out[f.name] = getattr(getattr(self, group), f.name)
        return out


def check_split_args(manifest: Any, split: Any, caller: str = "build_loader") -> None:
    """``(source, manifest, split)`` as ``build_loader`` and ``SampleDataset`` take them,
    checked before anything is read: ``manifest`` a ``SplitManifest``, ``split`` the name
    of one of its splits. The two swapped (a split name where the manifest goes, as when the
    manifest's variable is called ``split``) is a ``ConfigError`` naming both arguments; a
    name the manifest lacks an ``UnknownNameError`` listing the ones it has."""
    usage = f"{caller}(source, manifest, split): e.g. {caller}(source, splits, 'train')"
    if isinstance(split, SplitManifest) and not isinstance(manifest, SplitManifest):
        raise ConfigError(f"{usage}; got manifest={manifest!r} and split=<a SplitManifest "
                          f"of splits {list(split.names)}>: the two are swapped")
    if not isinstance(manifest, SplitManifest):
        raise ConfigError(f"{usage}; manifest must be a SplitManifest (from ib.split_by_chunk, "
                          f"ib.split_by_coordinate or ib.SplitManifest.from_json), got "
                          f"{type(manifest).__name__} {repr(manifest)[:80]}, with split="
                          f"{repr(split)[:80]}")
    if not isinstance(split, str):
        raise ConfigError(f"{usage}; split must be the name of one of the manifest's splits "
                          f"{list(manifest.names)}, got {type(split).__name__} "
                          f"{repr(split)[:80]}")
    if split not in manifest.names:
        raise UnknownNameError(f"{caller}: unknown split {split!r}; the manifest has splits "
                               f"{list(manifest.names)}")
