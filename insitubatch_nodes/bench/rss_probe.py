"""The loader alone in a fresh process: its peak RSS, for the memory target.

``python -m insitubatch_nodes.bench.rss_probe URL JSON_KWARGS [EPOCHS]`` prints one JSON line.
In a process that does nothing else, the peak RSS (``VmHWM``) is the loader's peak plus the
imports (measured separately as ``import_rss_bytes``), untouched by the benchmark's own
buffers. Not ``ru_maxrss``: Linux carries it across ``exec``, so a child of a big benchmark
process would report the parent's size.
"""

from __future__ import annotations

import json
import os
import sys


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """High-water RSS of this process image (``VmHWM``, reset by ``exec``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    from ..errors import LocalFileError  # here: the probe measures its imports

    raise LocalFileError("no VmHWM in /proc/self/status")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    url, kw = argv[0], json.loads(argv[1])
    epochs = int(argv[2]) if len(argv) > 2 else 2
    import insitubatch_nodes as ib
    from insitubatch_nodes.bench.common import bench_manifest

    variables = kw.pop("variables", None)
    source = ib.open_source(url, variables=variables)
    manifest = bench_manifest(source, kw.pop("split_fraction", 1.0), kw.get("seed", 0))
    import_rss = _rss()
    with ib.build_loader(source, manifest, "train", **kw) as loader:
        assert loader.ledger is not None  # build_loader's loaders have one
        for _ in range(epochs):
            for b in loader:
                del b
        out = {"import_rss_bytes": import_rss,
               "peak_rss_bytes": _peak_rss(),
               "resident_bound_bytes": loader.resident_bound,
               "ledger_peak_bytes": loader.ledger.peak, "epochs": epochs}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
