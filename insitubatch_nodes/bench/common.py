"""Measurement helpers shared by the core benchmark and the sweeps."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import LoaderConfig


def usage() -> np.ndarray:
    """(CPU s, of which system s, minor page faults) of the process and its reaped children
    (the naive DataLoader's workers). ``getrusage`` rather than ``os.times``, whose 10 ms
    ticks are too coarse for one pass; system time and faults show fresh-memory costs."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return np.array([own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime,
                     own.ru_stime + kids.ru_stime, own.ru_minflt + kids.ru_minflt])


def usage_extra(used: np.ndarray) -> dict[str, float]:
    return {"cpu_s": float(used[0]), "sys_s": float(used[1]), "minor_faults": int(used[2])}


@dataclass(frozen=True)
class Run:
    """One timed path: ``samples`` of ``sample_nbytes`` decoded bytes in ``seconds``."""

    name: str
    samples: int
    seconds: float
    sample_nbytes: int
    first_batch_s: float | None = None
    cpu_s: float | None = None
    # bytes, process (+ workers) at its highest during the run (a run timed without a
    # polling thread, RssSampler(poll=False): the larger of its start and its end)
    rss_peak: int | None = None
    rss_growth: int | None = None  # bytes above the RSS when the run started
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.samples * self.sample_nbytes / self.seconds / 1e9

    @property
    def cores(self) -> float | None:
        """CPU cores kept busy on average: tells starved parallelism from real work."""
        return None if self.cpu_s is None else self.cpu_s / self.seconds


class RssSampler:
    """Polls RSS on a thread: ``ru_maxrss`` is a lifetime peak, useless once an earlier step
    (store writing, zarr ``arr[:]``) has set it higher than the step being measured.

    With ``children=True`` (DataLoader workers) it sums the *proportional* set size (PSS) of
    the process and its children instead: RSS would count every page a forked worker shares
    with its parent once per process. ``poll=False`` samples on entry and exit only: a
    timed epoch the peers and floors run without a sampler must not carry one either (the
    100 Hz thread takes the GIL from the training thread); its memory is measured apart.
    """

    def __init__(self, interval_s: float | None = None, children: bool = False,
                 poll: bool = True) -> None:
        import psutil

        # Walking child processes costs CPU the workers need: poll them less often.
        self.interval_s = interval_s or (0.025 if children else 0.01)
        self.children = children
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = (threading.Thread(target=self._poll, name="rss-sampler", daemon=True)
                        if poll else None)
        self.baseline = 0
        self.peak = 0

    def _rss(self) -> int:
        if not self.children:
            return self._proc.memory_info().rss
        import psutil

        total = self._proc.memory_full_info().pss
        for c in self._proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += c.memory_full_info().pss
        return total

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RssSampler:
        self.baseline = self.peak = self._rss()
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


class OtherLoad:
    """CPU the rest of the machine used while we measured (other processes), in cores.

    A benchmark on a shared 2-core VM is only as good as its quietest run: this makes a busy
    machine visible in the results instead of silently slowing one path down.
    """

    def __init__(self) -> None:
        self.t0 = self.busy0 = self.own0 = 0.0
        self.cores: float | None = None

    @staticmethod
    def busy() -> float:
        """CPU seconds the whole machine has spent busy so far (idle, iowait and steal
        left out)."""
        import psutil

        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0)

    def __enter__(self) -> OtherLoad:
        self.t0, self.busy0, self.own0 = time.perf_counter(), self.busy(), float(usage()[0])
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> float:
        """End the measurement: the cores the rest of the machine used since ``__enter__``
        (also kept in ``cores``)."""
        wall = time.perf_counter() - self.t0
        other = (self.busy() - self.busy0) - (float(usage()[0]) - self.own0)
        self.cores = cores = max(0.0, other / wall) if wall > 0 else 0.0
        return cores


def rotated(names: Sequence[str], r: int) -> list[str]:
    """``names`` in round ``r``'s order: each starts a round in turn, so no path always runs
    right after the same other one (paired benchmarks alternate with it)."""
    k = r % len(names)
    return [*names[k:], *names[:k]]


def consume(batches: Iterable[Any], total: int, desc: str, key: str | None,
            progress: bool = True) -> tuple[int, float, float, np.ndarray]:
    """Iterate one epoch, touching each batch (one element) the way a model would read it.

    Returns (samples, seconds, time to first batch, ``usage`` delta); the clock starts before
    ``iter()`` so worker start-up and first window fetch are charged to the path that has them.
    """
    from tqdm import tqdm

    u0, t0 = usage(), time.perf_counter()
    first = None
    samples, acc = 0, 0.0
    it: Iterator[Any] = iter(batches)
    for batch in tqdm(it, total=total, desc=desc, unit="batch", file=sys.stderr,
                      mininterval=0.5, leave=False, disable=not progress):
        if first is None:
            first = time.perf_counter() - t0
        x = batch[key] if key is not None else batch
        acc += float(x.reshape(-1)[0])
        samples += int(x.shape[0])
    del it  # a DataLoader iterator reaps its workers here, so their CPU time is counted
    return samples, time.perf_counter() - t0, first or 0.0, usage() - u0


def warm_page_cache(path: Path) -> tuple[int, float]:
    """Read every file once so that no timed path pays for the disk (all paths see RAM)."""
    n, t0 = 0, time.perf_counter()
    buf = bytearray(8 << 20)
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while got := f.readinto(buf):  # a fixed buffer: shards can be GBs
                    n += got
    return n, time.perf_counter() - t0


def local_path(url: str) -> Path | None:
    """The directory of a local store URL (plain path or ``file://``), else ``None``."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        return Path(parts.path if parts.scheme == "file" else url).expanduser()
    return None


@dataclass(frozen=True)
class LoaderSettings:
    """The loader options every benchmark takes from the CLI (``bench`` and ``--sweep``)."""

    url: str
    variables: list[str] | None = None
    batch_size: int = 32
    block_chunks: int | None = 16  # None: what the loader picks (``--block-chunks auto``)
    max_inflight: int = 32
    decode_threads: int | None = None
    seed: int = 0

    def loader_kwargs(self) -> dict[str, Any]:
        """These options as ``build_loader`` keywords (to combine with overrides), checked
        by the loader's own ``LoaderConfig`` (an error names the field)."""
        kw = dict(batch_size=self.batch_size, block_chunks=self.block_chunks, seed=self.seed,
                  max_inflight=self.max_inflight, decode_threads=self.decode_threads)
        LoaderConfig.of(**kw)
        return kw


def one_epoch_at_a_time(package: Any = None) -> dict[str, Any]:
    """``build_loader`` keywords for a loader whose epochs are timed one at a time, in turn
    with other paths: its next epoch is not fetched ahead (that work would run in the others'
    time, and not in its own). Empty for an older version without the option (``package``:
    ``benchmarks/bench_revisions``), which never fetched ahead."""
    import dataclasses

    import insitubatch_nodes

    ib = package if package is not None else insitubatch_nodes
    fetch = getattr(ib, "FetchConfig", None)
    known = {f.name for f in dataclasses.fields(fetch)} if fetch is not None else set()
    return {"prefetch_next_epoch": False} if "prefetch_next_epoch" in known else {}


def write_json(path: Path, report: Any) -> None:
    """A benchmark's report as JSON at ``path``, its folder made first (a ``--json`` into a
    folder not made yet failed in one benchmark that wrote without it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def bench_manifest(source: Any, fraction: float, seed: int, package: Any = None) -> Any:
    """The split every benchmark measures: the first ``fraction`` of the chunks as "train"
    (made by ``package``, another version of this one, for ``benchmarks/bench_revisions``)."""
    import insitubatch_nodes

    ib = package if package is not None else insitubatch_nodes
    fractions = (fraction, 1 - fraction) if fraction < 1 else (1.0,)
    return ib.split_by_chunk(source, fractions=fractions, seed=seed)


def print_machine() -> dict[str, Any]:
    """``machine_info()``, printed as one line first (every benchmark's report starts so)."""
    machine = machine_info()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    return machine


def machine_info() -> dict[str, Any]:
    """Enough to tell whether two result files came from comparable machines."""
    import numcodecs
    import psutil
    import torch
    import zarr

    import insitubatch_nodes as ib

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": model,
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "zarr": zarr.__version__, "numcodecs": numcodecs.__version__,
            "insitubatch_nodes": ib.__version__, "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "cuda": torch.version.cuda}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
