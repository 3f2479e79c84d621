"""``insitubatch inspect``: what a store looks like to the loader, and a ``block_chunks`` to use.

For every variable: shape, dtype, dims, chunks and shards, samples per chunk, stored chunk
count, decoded bytes per chunk and per stripe, *measured* compressed bytes per chunk (the
sizes of a few stored objects, asked of the store), the codec chain, and the read path the
loader will take (``StripeReader.mode``). Then a ``block_chunks`` recommendation: the
smallest window whose modelled shuffle quality (``quality.shuffle_quality``) reaches the
target, capped by the memory budget through the loader's own resident bound (the bound
``build_loader(memory_budget=...)`` checks), so a recommendation always builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import zarr

from .defaults import decodes_in_place, default_prefetch_windows
from .errors import ConfigError
from .io.device_chain import HostOnly, device_chain_from
from .io.partial.blocks import Whole, plan_frame
from .io.partial.ranges import PartSpec
from .io.reader import StripeReader
from .io.served.axis import AxisStripeReader
from .memory.budget import largest_block_chunks, parse_bytes, resident_bound
from .memory.layout import Channel, build_layout
from .nodes.channels import resolve_channels, served_by
from .sampling.geometry import VariableGeometry
from .sampling.quality import recommend_block_chunks, shuffle_quality
from .sampling.windows import SampleWindow, default_run_chunks
from .store.axis_array import AxisArray
from .store.composed_array import ComposedArray
from .store.cut_array import CutArray
from .store.source import Source

READ_PATHS = {
    "local": "local file read + decode straight into the window or batch, small stripes "
             "grouped a few per pool task",
    "object": "obstore get_async on the event loop, decode on the pool",
    "zarr-store": "zarr async store.get, decode on the pool",
    "zarr": "zarr async getitem per stripe (codec chain not special-cased), one copy into "
            "the window",
}


@dataclass(frozen=True)
class VariableReport:
    name: str
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[str | None, ...] | None
    chunks: tuple[int, ...]  # the read unit (inner chunk when sharded)
    shards: tuple[int, ...] | None
    samples_per_chunk: int
    sample_chunks: int  # chunks along the sample axis (stripes)
    chunks_per_stripe: int  # stored chunks that make one stripe (chunking inside a sample)
    stored_chunks: int  # chunks in the whole array
    decoded_chunk_bytes: int
    decoded_stripe_bytes: int
    compressed_chunk_bytes: float | None  # mean over the measured objects, per chunk
    measured_objects: int  # stored objects (chunks or shards) whose size was asked
    missing_objects: int  # of those, never written (read as fill value)
    compression_ratio: float | None
    codecs: str  # zarr's codec chain
    fast_decoder: str | None  # our numcodecs chain, when special-cased
    decoded_by: str | None  # the libraries that decode it then (numcodecs, c-blosc2, ...)
    read_mode: str
    read_path: str
    gpu_decode: str  # what decode="gpu" does with this variable, and why
    # of the values in the sampled stripes, missing (NaN or infinite); None: none sampled
    nan_fraction: float | None = None
    # with channels: what of each chunk they read (blosc blocks, bytes), or why all of it
    partial_read: str | None = None


@dataclass(frozen=True)
class Recommendation:
    quality_target: float
    memory_budget: int | None
    batch_size: int
    prefetch_windows: int
    block_chunks_for_quality: int  # smallest reaching the target (uncapped)
    block_chunks_memory_cap: int | None  # largest whose resident bound fits the budget
    block_chunks: int | None  # what to use (None: nothing fits the budget)
    quality: float | None  # modelled score at block_chunks
    resident_bound_bytes: int | None  # at block_chunks
    note: str
    run_chunks: int | None = None  # time steps: chunks per contiguous run


@dataclass(frozen=True)
class StoreReport:
    url: str
    n_samples: int
    samples_per_chunk: int  # of the sample grid (LCM of the variables')
    n_chunks: int
    sample_nbytes: int
    variables: tuple[VariableReport, ...]
    recommendation: Recommendation | None
    # the sample axis in its own terms: "time 2000-01-01T03:00 .. 2000-01-05T06:00, every 1h"
    sample_axis: str | None = None
    coordinates: dict[str, str] | None = None  # other 1-D coordinates: name -> values
    static: tuple[str, ...] = ()  # fields without the sample axis (open_static)
    # the channels asked for, by name: the figures above are then a loader's given them
    channels: tuple[str, ...] = ()
    # a composed source (join, concat, period): each store it reads, described
    members: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _measure_sizes(reader: StripeReader, samples: int) -> tuple[list[int], int]:
    """Sizes in bytes of up to ``samples`` stored objects along the sample axis (first inner
    chunk of each), evenly spaced; and how many of the asked objects do not exist."""
    from zarr.core.sync import sync

    geom = reader.geom
    store = reader.arr.store_path.store
    unit = geom.shards or geom.chunks
    n_along = -(-geom.shape[0] // unit[0])
    picks = np.unique(np.linspace(0, n_along - 1, min(samples, n_along)).astype(int))
    sizes, missing = [], 0
    for i in picks.tolist():
        key = reader.chunk_key((i,) + (0,) * (len(geom.shape) - 1))
        try:
            sizes.append(int(sync(store.getsize(key))))
        except FileNotFoundError:
            missing += 1
    return sizes, missing


def _channel_parts(source: Source, channels: Sequence[Channel]) -> list[PartSpec | None]:
    """Per variable, what ``channels`` (resolved) take of its samples (``None``: all)."""
    if not channels:
        return [None] * len(source.variables)
    layout = build_layout(source.variables, channels)
    return [PartSpec.for_slot(tuple((pl.key, None, pl) for pl in pls), g.sample_shape)
            for pls, g in zip(layout.placements, source.variables, strict=True)]


def _partial_read(reader: StripeReader, part: PartSpec, samples: int) -> str:
    """What a read of ``part`` takes of up to ``samples`` stored chunks (their first inner
    chunk, evenly spaced along the sample axis): blosc blocks and compressed bytes, or why
    the whole chunk is read."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    geom = reader.geom
    cp = (reader.chunk_parts(part) or [None])[0]
    levels = sum(b - a for a, b in part.ranges)
    what = f"{levels} of {geom.sample_shape[0]} levels (or anemoi variables)"
    if cp is None or cp.whole:
        return f"{what}: every stored chunk is read whole (the part spans each one)"
    if not reader.blocks_ok:
        return f"{what}: whole chunks ({reader.codec_chain.label} is not a lone blosc)"
    store = reader.arr.store_path.store
    n_along = -(-geom.shape[0] // geom.chunks[0])
    picks = np.unique(np.linspace(0, n_along - 1, min(samples, n_along)).astype(int))
    blocks = total = got = whole = planned = 0
    reason = ""
    for i in picks.tolist():
        key = reader.chunk_key((i,) + (0,) * (len(geom.shape) - 1))
        buf = sync(store.get(key, prototype=default_buffer_prototype()))
        if buf is None:
            continue
        frame = buf.to_bytes()
        plan = plan_frame(frame, reader.chunk_nbytes, cp.byte_ranges)
        whole += len(frame)
        if isinstance(plan, Whole):
            got, reason = got + len(frame), plan.reason
            continue
        blocks += len(plan.blocks)
        total += plan.header.nblocks
        planned += 1
        got += plan.header.head_bytes + plan.span_bytes
    if not whole:
        return f"{what}: no stored chunk sampled"
    if not total:
        return f"{what}: whole chunks ({reason})"
    return (f"{what}: {blocks / planned:.0f} of {total / planned:.0f} blosc blocks a chunk, "
            f"{got / whole:.2f} of the compressed bytes (decoded in part; on object stores "
            "fetched in part where the second round trip pays)")


def inspect_variable(arr: zarr.Array | AxisArray, geom: Any, source_url: str,
                     sample_objects: int = 5, part: PartSpec | None = None) -> VariableReport:
    reader = (AxisStripeReader(arr, geom, source_url) if isinstance(arr, AxisArray)
              else StripeReader(arr, geom, source_url))
    chunk_items = int(np.prod(geom.chunks, dtype=np.int64))
    decoded_chunk = chunk_items * geom.dtype.itemsize
    per_stripe = int(np.prod(geom.inner_grid, dtype=np.int64)) if geom.inner_grid else 1
    sizes, missing = _measure_sizes(reader, sample_objects)
    nan_fraction = _sampled_nan_fraction(reader, sample_objects)
    per_object = 1
    if geom.shards:
        per_object = int(np.prod([s // c for s, c in zip(geom.shards, geom.chunks, strict=True)]))
    compressed = float(np.mean(sizes)) / per_object if sizes else None
    return VariableReport(
        name=geom.name, shape=geom.shape, dtype=str(geom.dtype), dims=geom.dimension_names,
        chunks=geom.chunks, shards=geom.shards, samples_per_chunk=geom.sample_chunk,
        sample_chunks=geom.n_sample_chunks, chunks_per_stripe=per_stripe,
        stored_chunks=geom.n_sample_chunks * per_stripe,
        decoded_chunk_bytes=decoded_chunk, decoded_stripe_bytes=geom.stripe_nbytes,
        compressed_chunk_bytes=compressed, measured_objects=len(sizes) + missing,
        missing_objects=missing,
        compression_ratio=decoded_chunk / compressed if compressed else None,
        codecs=reader.codec_chain.label,
        fast_decoder=reader.decoder.chain if reader.decoder else None,
        decoded_by=reader.decoder.libraries if reader.decoder else None,
        read_mode=reader.mode, read_path=READ_PATHS.get(reader.mode, reader.mode),
        gpu_decode=_gpu_verdict(reader), nan_fraction=nan_fraction,
        partial_read=None if part is None else _partial_read(reader, part, sample_objects),
    )


def _sampled_nan_fraction(reader: StripeReader, samples: int) -> float | None:
    """The missing (non-finite) fraction of up to ``samples`` stripes, evenly spaced along
    the sample axis, decoded as the loader would: a hint (ERA5's sea-surface temperature is
    NaN over land), not a statistic (``compute_stats`` records the split's)."""
    geom = reader.geom
    if geom.dtype.kind != "f" or samples < 1:
        return None
    from zarr.core.sync import sync

    picks = np.unique(np.linspace(0, geom.n_sample_chunks - 1,
                                  min(samples, geom.n_sample_chunks)).astype(int)).tolist()
    stripes = sync(_read_stripes(reader, picks))
    bad = total = 0
    for i, out in zip(picks, stripes, strict=True):
        rows = reader.rows(i)
        valid = out[: rows.stop - rows.start]
        bad += int(valid.size - np.isfinite(valid).sum())
        total += valid.size
    return bad / total if total else None


async def _read_stripes(reader: StripeReader, indices: list[int]) -> list[np.ndarray]:
    """Stripes ``indices`` through the reader's own read path, one decode thread for all."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    geom = reader.geom
    outs = [np.empty(geom.stripe_shape, geom.dtype) for _ in indices]
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1) as pool:
        for i, out in zip(indices, outs, strict=True):
            await reader.read(i, out, loop, pool)
    return outs


def _sample_axis(source: Source) -> str | None:
    """The sample axis in its own terms: ISO dates, their range and step for a time axis."""
    values = source.sample_coord
    dim = source.sample_dim or "sample"
    if values is None or len(values) == 0:
        return None
    v = np.asarray(values)
    if np.issubdtype(v.dtype, np.datetime64):
        first, last = (np.datetime_as_string(x, unit="m") for x in (v[0], v[-1]))
        steps = (np.unique(np.diff(v.astype("datetime64[m]"))) if v.size > 1
                 else np.empty(0, dtype="timedelta64[m]"))
        every = (f", every {_duration(steps[0])}" if len(steps) == 1
                 else f", irregular steps ({len(steps)} kinds)" if len(steps) else "")
        return f"{dim} {first} .. {last}{every}"
    return f"{dim} {v[0]} .. {v[-1]}"


def _duration(step: np.timedelta64) -> str:
    minutes = int(step.astype("timedelta64[m]").astype(np.int64))
    for unit, size in (("D", 1440), ("h", 60)):
        if minutes % size == 0:
            return f"{minutes // size}{unit}"
    return f"{minutes}min"


def _coordinates(source: Source) -> dict[str, str]:
    """The 1-D coordinate arrays beside the variables (levels, latitude...), in short."""
    out: dict[str, str] = {}
    if source.group is None:
        return out
    dims = {d for v in source.variables for d in (v.dimension_names or ())[1:] if d}
    for name in sorted(dims):
        try:
            values = source.coordinate(name)
        except (KeyError, ValueError):
            continue
        if values.ndim != 1:
            continue
        text = [f"{x:g}" if isinstance(x, float) else str(x) for x in values.tolist()]
        out[name] = (", ".join(text) if len(text) <= 16 else
                     f"{text[0]} .. {text[-1]} ({len(text)} values)")
    return out


def _gpu_verdict(reader: StripeReader) -> str:
    if isinstance(reader, AxisStripeReader):
        return ("no, decoded on the CPU: sampled along a stored axis other than the first "
                "(each chunk is copied transposed)")
    chain = device_chain_from(reader.codec_chain)
    if isinstance(chain, HostOnly):
        return f"no, decoded on the CPU: {chain.reason}"
    return f"yes ({chain.algorithm or 'uncompressed'})"


def recommend(source: Source, quality: float, memory_budget: int | str | None = None,
              batch_size: int = 32, prefetch_windows: int | None = None,
              in_place: bool | None = None, steps: SampleWindow | None = None,
              ) -> Recommendation:
    """``block_chunks`` for a target shuffle quality, capped by a memory budget (with the
    loader's own default ``prefetch_windows``, 2, unless given: decode workers, which fetch
    deeper, need it given). With time
    ``steps``, also the run length: runs long enough that halos add <= 25% to the reads,
    and as many runs per window as the quality asks for (scored over runs)."""
    if not 0 < quality <= 1:
        raise ConfigError(f"quality must be in (0, 1], got {quality!r}")
    if steps is not None and steps.is_single_step:
        steps = None
    if prefetch_windows is None:
        prefetch_windows = default_prefetch_windows()
    n_chunks, cs = source.grid.n_chunks, source.grid.chunk_size
    run = None if steps is None else min(default_run_chunks(steps, cs), n_chunks)
    step = 1 if run is None else run  # block_chunks in whole runs
    n_units, unit = (n_chunks, cs) if run is None else (-(-n_chunks // run), run * cs)

    def score(block: int) -> float:
        return shuffle_quality(n_units, unit, max(1, block // step), batch_size)

    want = recommend_block_chunks(n_units, unit, batch_size, quality) * step
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    grid, variables = source.grid, source.variables
    if in_place is None:  # what build_loader decides with its defaults (time steps too)
        in_place = decodes_in_place(source)
    runs = 1 if run is None else max(1, want // run)

    def bound(block: int) -> int:
        return resident_bound(grid, variables, block, prefetch_windows, batch_size, steps,
                              in_place, 1 if run is None else max(1, block // run))

    cap = (largest_block_chunks(grid, variables, budget, prefetch_windows, batch_size,
                                max(n_chunks, want), steps, in_place, run)
           if budget is not None else None)
    if cap is not None and run is not None:
        cap = cap // run * run or None  # whole runs only
    if budget is not None and cap is None:
        need = bound(step)
        return Recommendation(quality, budget, batch_size, prefetch_windows, want, None, None,
                              None, None,
                              f"even block_chunks={step} needs {need:,} B resident, above the "
                              f"budget of {budget:,} B: raise the budget or lower "
                              "prefetch_windows", run)
    block = want if cap is None else min(want, cap)
    q = score(block)
    if q < quality and block < want:
        note = (f"the budget caps block_chunks at {cap}: quality {q:.3f} < target {quality}")
    elif q < quality:
        note = (f"even a window of all {n_chunks} chunks reaches only {q:.3f} (a batch of "
                f"{batch_size} from chunks of {cs} samples)")
    else:
        note = f"reaches the target {quality}"
    if run is not None:
        note += (f"; runs of {run} chunks keep halo reads <= 25%, {max(1, block // run)} runs "
                 f"per window (quality alone asks for {runs})")
    return Recommendation(quality, budget, batch_size, prefetch_windows, want, cap, block, q,
                          bound(block), note, run)


def inspect_source(source: Source, *, quality: float | None = 0.9,
                   memory_budget: int | str | None = None, batch_size: int = 32,
                   prefetch_windows: int | None = None, sample_objects: int = 5,
                   steps: SampleWindow | None = None,
                   channels: Sequence[str | tuple[str, Any]] | None = None) -> StoreReport:
    """Describe every served variable and recommend ``block_chunks`` (``quality=None``: no
    recommendation); with ``channels`` (as ``build_loader`` takes them; an anemoi
    ``variables=`` selection counts as such), how much of each chunk they read, and the
    figures of what a loader with them reads (only the channels' variables, where
    ``open_source`` discovered the variables)."""
    chosen = resolve_channels(source, channels) if channels else []
    source = served_by(source, chosen)
    picks = chosen or (resolve_channels(source, source.selection) if source.selection else [])
    parts = _channel_parts(source, picks)
    variables = tuple(inspect_variable(a, g, url, sample_objects, part)
                      for arr, geom, part in zip(source.arrays, source.variables, parts,
                                                 strict=True)
                      for a, g, url in _stored(arr, geom, source.url))
    rec = (recommend(source, quality, memory_budget, batch_size, prefetch_windows,
                     steps=steps) if quality is not None else None)
    return StoreReport(url=source.url, n_samples=source.n_samples,
                       samples_per_chunk=source.grid.chunk_size, n_chunks=source.grid.n_chunks,
                       sample_nbytes=source.sample_nbytes, variables=variables,
                       recommendation=rec, sample_axis=_sample_axis(source),
                       coordinates=_coordinates(source), static=tuple(source.static),
                       channels=tuple(c.label or c.variable for c in chosen),
                       members=tuple(m.describe() for m in source.members))


def _stored(arr: zarr.Array | ComposedArray | CutArray | AxisArray, geom: VariableGeometry,
            url: str) -> list[tuple[zarr.Array | AxisArray, VariableGeometry, str]]:
    """The stored arrays a served variable reads: a composed one's, each named for its
    member, so the report shows every store's chunking and read path (of a part of the
    grid: the stored array's)."""
    if isinstance(arr, CutArray):
        return _stored(arr.base, arr.base_geom, url)
    if not isinstance(arr, ComposedArray):
        return [(arr, geom, url)]
    return [(a, replace(g, name=f"{geom.name} [member {m}]"), u)
            for m, (a, g, u) in enumerate(zip(arr.arrays, arr.geoms, arr.urls, strict=True))]


def _mb(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_report(r: StoreReport) -> str:
    served = ("all variables" if not r.channels else
              "the variables a loader given these channels reads: "
              + ", ".join(v.name for v in r.variables))
    lines = [f"store {r.url}", *(f"  {m}" for m in r.members),
             f"  {r.n_samples} samples along the sample axis, {_mb(r.sample_nbytes)} per sample "
             f"({served}); loader chunks of {r.samples_per_chunk} samples: {r.n_chunks}"]
    if r.channels:
        lines.append(f"  channels: {', '.join(r.channels)}")
    if r.sample_axis:
        lines.append(f"  {r.sample_axis}")
    for name, values in (r.coordinates or {}).items():
        lines.append(f"  {name}: {values}")
    if r.static:
        lines.append(f"  static fields (ib.open_static): {', '.join(r.static)}")
    lines.append("")
    for v in r.variables:
        dims = ", ".join(str(d) for d in v.dims) if v.dims else "-"
        lines += [
            f"variable {v.name}: shape {v.shape} {v.dtype} ({dims})",
            f"  chunks {v.chunks}" + (f", shards {v.shards}" if v.shards else "")
            + f"; {v.samples_per_chunk} samples per chunk; {v.sample_chunks} chunks along the "
            f"sample axis x {v.chunks_per_stripe} per stripe = {v.stored_chunks} chunks",
            f"  bytes per chunk: {_mb(v.decoded_chunk_bytes)} decoded, "
            f"{_mb(v.compressed_chunk_bytes)} compressed"
            + (f" (ratio {v.compression_ratio:.2f}" if v.compression_ratio else " (")
            + f"; measured on {v.measured_objects} stored "
            + ("shards" if v.shards else "chunks")
            + (f", {v.missing_objects} never written" if v.missing_objects else "") + ")"
            + f"; per stripe {_mb(v.decoded_stripe_bytes)} decoded",
            f"  codecs: {v.codecs}"
            + (f"; fast decoder: {v.fast_decoder} ({v.decoded_by})" if v.fast_decoder
               else ""),
            f"  read path: {v.read_mode} ({v.read_path})",
            *([f"  missing values: {v.nan_fraction:.1%} NaN in the stripes sampled "
               "(compute_stats leaves them out; fill_nan= / mask= serve them)"]
              if v.nan_fraction else []),
            f"  decode='gpu': {v.gpu_decode}",
            *([f"  channels read: {v.partial_read}"] if v.partial_read else []),
            "",
        ]
    rec = r.recommendation
    if rec is not None:
        budget = _mb(rec.memory_budget) if rec.memory_budget is not None else "none"
        lines.append(f"recommendation (shuffle quality >= {rec.quality_target}, memory budget "
                     f"{budget}, batch {rec.batch_size}, prefetch_windows "
                     f"{rec.prefetch_windows}):")
        if rec.block_chunks is None:
            lines.append(f"  nothing fits: {rec.note}")
        else:
            cap = ("" if rec.block_chunks_memory_cap is None
                   else f"; the budget allows up to {rec.block_chunks_memory_cap}")
            runs = "" if rec.run_chunks is None else f", run_chunks={rec.run_chunks}"
            lines.append(f"  block_chunks={rec.block_chunks}{runs} -> modelled quality "
                         f"{rec.quality:.3f}, resident bound {_mb(rec.resident_bound_bytes)} "
                         f"({rec.note}; quality alone asks for "
                         f"{rec.block_chunks_for_quality}{cap})")
    return "\n".join(lines)
