"""Which library decodes each codec fastest into a given buffer, alone and on two threads.

``io/decode.py`` decodes the chains we special-case with numcodecs, gzip and zlib with
libdeflate (imagecodecs) where installed; this benchmark is the measurement behind that
choice (DESIGN.md, "Decoders"). Each candidate decodes the same
frames into one preallocated buffer per thread, as the loader does: one thread (the cost of
a chunk) and two threads (the decode pool on the project's 2-core VM: a library that holds
the GIL, or runs its own threads, does not scale). Rounds alternate the candidates and a
ratio is the median over rounds of (numcodecs seconds / candidate seconds), so the VM's
drift cancels. Run on demand, never as a test::

    .venv/bin/python -m benchmarks.bench_decoders              # ~1 min
    .venv/bin/python -m benchmarks.bench_decoders --rounds 9 --json bench-out/decoders.json

Frames are chunks of the fields ``synthetic.py`` writes: ERA5-like t2m (181 x 360 float32,
1 step per chunk) and WeatherBench2 temperature (13 levels x 240 x 121), compressed as the
archives are (blosc zstd / lz4 with byte shuffle), and the same t2m frames with zarr v3's
plain ``zstd`` and ``gzip`` codecs and HDF5's deflate (``zlib``). Candidates: numcodecs
(always), imagecodecs and python-blosc2 where installed (``pip install imagecodecs blosc2``):
python-blosc2's ``decompress`` as it is, and ``c-blosc2 ctx``, its library driven as
``io/blosc2_lib.py`` does (a decompression context per thread, GIL released); a missing one
is listed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numcodecs  # noqa: E402
import numcodecs.blosc  # noqa: E402
import numpy as np  # noqa: E402

from insitubatch_nodes.bench.common import write_json  # noqa: E402
from insitubatch_nodes.io import blosc2_lib  # noqa: E402
from insitubatch_nodes.synthetic import DemoSpec, WB2Spec, fields, wb2_fields  # noqa: E402

Decode = Callable[[bytes, np.ndarray], object]


@dataclass(frozen=True)
class Case:
    name: str
    frames: list[bytes]
    shape: tuple[int, ...]
    dtype: np.dtype
    codec: str  # "blosc", "zstd", "gzip" or "zlib": which candidates apply


def make_cases(n: int) -> list[Case]:
    """``n`` frames per case, each a chunk of one time step."""
    t2m = fields(DemoSpec(n_times=n, n_lat=181, n_lon=360, variables=("t2m",), coords=False),
                 0, n, np.random.default_rng(0))["t2m"]
    wb2 = wb2_fields(WB2Spec(n_times=n), 0, n)["temperature"]
    zstd = numcodecs.Blosc(cname="zstd", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)
    lz4 = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)
    plain_zstd, gzip = numcodecs.Zstd(level=5), numcodecs.GZip(level=5)
    zlib = numcodecs.Zlib(level=5)
    return [
        Case("t2m 181x360 f32, blosc zstd+shuffle", [zstd.encode(f) for f in t2m],
             t2m.shape[1:], t2m.dtype, "blosc"),
        Case("WB2 temperature 13x240x121 f32, blosc lz4+shuffle", [lz4.encode(f) for f in wb2],
             wb2.shape[1:], wb2.dtype, "blosc"),
        Case("t2m 181x360 f32, zstd (zarr v3 codec)", [plain_zstd.encode(f) for f in t2m],
             t2m.shape[1:], t2m.dtype, "zstd"),
        Case("t2m 181x360 f32, gzip (zarr v3 codec)", [gzip.encode(f) for f in t2m],
             t2m.shape[1:], t2m.dtype, "gzip"),
        Case("t2m 181x360 f32, zlib (HDF5 deflate, NetCDF4 via virtualizarr)",
             [zlib.encode(f) for f in t2m], t2m.shape[1:], t2m.dtype, "zlib"),
    ]


def candidates(codec: str) -> tuple[dict[str, Decode], list[str]]:
    """(name -> decode(frame, out)) for ``codec``, and the libraries not installed."""
    out: dict[str, Decode] = {}
    missing: list[str] = []
    if codec == "blosc":
        out["numcodecs"] = lambda b, o: numcodecs.blosc.decompress(b, o)
    elif codec == "zstd":
        z = numcodecs.Zstd()
        out["numcodecs"] = lambda b, o: z.decode(b, out=o)
    else:
        c = numcodecs.GZip() if codec == "gzip" else numcodecs.Zlib()
        out["numcodecs"] = lambda b, o: c.decode(b, out=o)
    try:
        import imagecodecs

        def flat(o: np.ndarray) -> memoryview:  # decoded into, in place
            return o.reshape(-1).view(np.uint8).data

        if codec == "blosc":
            out["imagecodecs"] = lambda b, o: imagecodecs.blosc_decode(b, numthreads=1,
                                                                       out=flat(o))
        elif codec == "zstd":
            out["imagecodecs"] = lambda b, o: imagecodecs.zstd_decode(b, out=flat(o))
        elif codec == "gzip":
            out["imagecodecs"] = lambda b, o: imagecodecs.gzip_decode(b, out=flat(o))
        else:  # libdeflate; imagecodecs.zlib_decode (zlib itself) measured as numcodecs
            out["imagecodecs"] = lambda b, o: imagecodecs.deflate_decode(b, out=flat(o))
    except ImportError:
        missing.append("imagecodecs")
    if codec == "blosc":
        try:
            import blosc2

            blosc2.set_nthreads(1)  # one thread per call: the pool gives the parallelism
            out["blosc2"] = lambda b, o: blosc2.decompress(b, dst=o)
        except ImportError:
            missing.append("blosc2")
        lib = blosc2_lib.load()  # what io/decode.py uses: c-blosc2, a context per thread
        if lib is not None:
            def ctx(b: bytes, o: np.ndarray, lib: Any = lib) -> None:
                if not lib.decompress_into(b, o):
                    raise RuntimeError("c-blosc2 declined a frame numcodecs wrote")

            out["c-blosc2 ctx"] = ctx
        else:
            missing.append("c-blosc2 ctx (python-blosc2's library)")
    return out, missing


def one_pass(decode: Decode, frames: list[bytes], outs: list[np.ndarray]) -> float:
    """Seconds to decode every frame, split over ``len(outs)`` threads."""
    k = len(outs)

    def work(i: int) -> None:
        for b in frames[i::k]:
            decode(b, outs[i])

    t0 = time.perf_counter()
    if k == 1:
        work(0)
    else:
        with ThreadPoolExecutor(k) as ex:
            list(ex.map(work, range(k)))
    return time.perf_counter() - t0


def run_case(case: Case, rounds: int) -> dict[str, Any]:
    decs, missing = candidates(case.codec)
    ref = np.empty(case.shape, case.dtype)
    decs["numcodecs"](case.frames[0], ref)
    for name, dec in decs.items():  # every candidate decodes to the same bytes
        got = np.empty_like(ref)
        dec(case.frames[0], got)
        if not np.array_equal(got.view(np.uint8), ref.view(np.uint8)):
            raise RuntimeError(f"{name} decoded {case.name} differently from numcodecs")
    secs: dict[tuple[str, int], list[float]] = {(n, k): [] for n in decs for k in (1, 2)}
    names = list(decs)
    for r in range(rounds + 1):  # round 0 warms up and is dropped
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            for k in (1, 2):
                outs = [np.ones(case.shape, case.dtype) for _ in range(k)]
                s = one_pass(decs[name], case.frames, outs)
                if r:
                    secs[(name, k)].append(s)
    n = len(case.frames)
    rows = []
    for name in names:
        row: dict[str, Any] = {"decoder": name}
        for k in (1, 2):
            mine, base = np.array(secs[(name, k)]), np.array(secs[("numcodecs", k)])
            row[f"us_per_chunk_{k}t"] = float(np.median(mine)) / n * 1e6
            row[f"speedup_{k}t"] = float(np.median(base / mine))
        rows.append(row)
    raw = int(np.prod(case.shape)) * np.dtype(case.dtype).itemsize
    ratio = raw / float(np.mean([len(f) for f in case.frames]))
    return {"case": case.name, "frames": n, "raw_bytes": raw, "compression_ratio": ratio,
            "rows": rows, "missing": missing}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=200, help="chunks per case (default 200)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    print(f"cores: {os.cpu_count()}; numcodecs {numcodecs.__version__}; "
          f"{args.frames} frames per case, {args.rounds} rounds (median)")
    results = []
    for case in make_cases(args.frames):
        res = run_case(case, args.rounds)
        results.append(res)
        print(f"\n{res['case']} (compression {res['compression_ratio']:.1f}x"
              + (f"; not installed: {', '.join(res['missing'])}" if res["missing"] else "")
              + ")")
        print(f"  {'decoder':14s} {'1 thread us/chunk':>18s} {'x numcodecs':>12s} "
              f"{'2 threads us/chunk':>19s} {'x numcodecs':>12s}")
        for row in res["rows"]:
            print(f"  {row['decoder']:14s} {row['us_per_chunk_1t']:18.1f} "
                  f"{row['speedup_1t']:12.2f} {row['us_per_chunk_2t']:19.1f} "
                  f"{row['speedup_2t']:12.2f}")
    if args.json is not None:
        write_json(args.json, results)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
