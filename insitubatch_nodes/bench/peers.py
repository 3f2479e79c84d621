"""Peers in ``insitubatch bench``: zarr-beluga and tensorstore reading the same store.

Each peer reads the split's samples once per epoch in a random order (a new permutation per
epoch, the same for every peer), one epoch right after each of the loader's, so a drifting
VM slows both sides of a ratio alike. Both are optional (``pip install
'insitubatch-nodes[peers]'``): a peer that is not installed, cannot open the store, or is
asked of a remote store gives a row saying so, never a failed benchmark. Local stores only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError
from . import PEER_NAMES, PEERS_HINT
from .common import Run, fmt, usage

_MODULES = {"zarr-beluga": "beluga", "tensorstore": "tensorstore"}
TS_IN_FLIGHT = 2  # tensorstore batches read at once


class PeerPass(Protocol):
    """One way a peer reads an epoch: ``tensors(order)`` yields what it hands a training
    loop (samples or batches, as torch tensors) for the samples of ``order``; ``run_pass``
    times one epoch of it, touching every tensor as ``consume`` does."""

    name: str
    peer: str

    def tensors(self, order: np.ndarray) -> Iterator[Any]: ...

    def run_pass(self, order: np.ndarray) -> float: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Unavailable:
    """A peer (or one of its passes, ``name``) that gives no number here, and why: a row of
    its own in the report."""

    peer: str
    reason: str
    name: str = ""


def _version(peer: str) -> str:
    try:
        return importlib.metadata.version(peer)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _timed_pass(tensors: Iterator[Any]) -> float:
    """Seconds to drain ``tensors``, reading one element of each (as ``consume`` does)."""
    acc, t0 = 0.0, time.perf_counter()
    for x in tensors:
        acc += float(x.reshape(-1)[0])
        del x  # beluga reuses a sample's memory once no tensor holds it
    return time.perf_counter() - t0


class BelugaPass:
    """zarr-beluga in one ``zarr_read`` mode: ``reader.stream(order, frames=1)``, every
    sample taken as a ``(1, C, H, W)`` torch tensor by DLPack (no copy), as its docs show
    for training."""

    peer = "zarr-beluga"

    def __init__(self, root: Path, variables: Sequence[str], mode: str) -> None:
        import beluga

        self.mode = mode
        self.name = f"zarr-beluga {_version(self.peer)} ({mode})"
        self.reader = beluga.open_zarr_group(str(root.parent), root.name,
                                             variables=list(variables),
                                             sched={"extra": {"zarr_read": mode}})

    def tensors(self, order: np.ndarray) -> Iterator[Any]:
        import torch

        for sample in self.reader.stream(order.tolist(), frames=1):
            yield torch.from_dlpack(sample)

    def run_pass(self, order: np.ndarray) -> float:
        return _timed_pass(self.tensors(order))

    def close(self) -> None:
        self.reader = None


class TensorstorePass:
    """tensorstore: per batch of ``batch_size`` sorted sample indices, one
    ``arr.oindex[idx].read()`` per variable, ``TS_IN_FLIGHT`` batches in flight, no cache
    (``cache_pool`` 0, in one context the arrays share, so they share its thread pools), so
    every epoch reads and decodes the store as the loader does. Yields one tensor per
    variable and batch."""

    peer = "tensorstore"

    def __init__(self, root: Path, variables: Sequence[str], zarr_formats: Sequence[int],
                 batch_size: int) -> None:
        import tensorstore as ts

        self.name = f"tensorstore {_version(self.peer)}"
        self.batch_size = batch_size
        context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        self.arrays = [
            ts.open({"driver": "zarr3" if fmt == 3 else "zarr",
                     "kvstore": {"driver": "file", "path": str(root / name)}},
                    context=context, read=True).result()
            for name, fmt in zip(variables, zarr_formats, strict=True)]

    def tensors(self, order: np.ndarray) -> Iterator[Any]:
        import torch

        pending: deque[list[Any]] = deque()
        for b0 in range(0, order.size, self.batch_size):
            idx = np.sort(order[b0:b0 + self.batch_size])
            pending.append([a.oindex[idx].read() for a in self.arrays])
            if len(pending) == TS_IN_FLIGHT:
                yield from (torch.from_numpy(f.result()) for f in pending.popleft())
        while pending:
            yield from (torch.from_numpy(f.result()) for f in pending.popleft())

    def run_pass(self, order: np.ndarray) -> float:
        return _timed_pass(self.tensors(order))

    def close(self) -> None:
        self.arrays = []


def open_peers(root: Path | None, source: Any, peers: Sequence[str],
               beluga_modes: Sequence[str], batch_size: int,
               ) -> tuple[list[PeerPass], list[Unavailable]]:
    """The peers' read passes on the store at ``root`` (``None``: a remote store), and a
    reason for each peer that cannot run here."""
    passes: list[PeerPass] = []
    missing: list[Unavailable] = []
    for peer in peers:
        if peer not in _MODULES:
            raise ConfigError(f"unknown peer {peer!r}; known: {', '.join(PEER_NAMES)}")
        if importlib.util.find_spec(_MODULES[peer]) is None:
            missing.append(Unavailable(peer, f"not installed ({PEERS_HINT})"))
            continue
        if root is None:
            missing.append(Unavailable(peer, "local stores only"))
            continue
        try:
            if peer == "zarr-beluga":
                passes += [BelugaPass(root, source.names, m) for m in beluga_modes]
            else:
                formats = [a.metadata.zarr_format for a in source.arrays]
                passes.append(TensorstorePass(root, source.names, formats, batch_size))
        except Exception as e:  # a peer that cannot read this store is a row, not a failure
            missing.append(Unavailable(peer, f"cannot open the store: {type(e).__name__}: {e}"))
    return passes, missing


class PeerEpochs:
    """The peers' passes, one epoch each per ``run_epoch``: every sample of the split in a
    permutation drawn from ``(seed, epoch)``, the same for every peer. A peer that fails
    mid-run is dropped with its error (a row that says so)."""

    def __init__(self, passes: Sequence[PeerPass], samples: np.ndarray, seed: int) -> None:
        self.passes = list(passes)
        self.samples = np.asarray(samples, dtype=np.int64)
        self.seed = seed
        self.seconds: dict[str, dict[int, float]] = {p.name: {} for p in self.passes}
        self.cpu_s: dict[str, dict[int, float]] = {p.name: {} for p in self.passes}
        self.failed: list[Unavailable] = []

    def run_epoch(self, epoch: int) -> None:
        order = np.random.default_rng((self.seed, epoch)).permutation(self.samples)
        for p in list(self.passes):
            u0 = usage()
            try:
                self.seconds[p.name][epoch] = p.run_pass(order)
            except Exception as e:
                self.failed.append(Unavailable(p.peer, f"failed: {type(e).__name__}: {e}",
                                               p.name))
                self.passes.remove(p)
                del self.seconds[p.name], self.cpu_s[p.name]
                p.close()
                continue
            self.cpu_s[p.name][epoch] = float((usage() - u0)[0])

    def close(self) -> None:
        for p in self.passes:
            p.close()


def paired_ratio(ours: dict[int, float], theirs: dict[int, float],
                 epochs: Sequence[int]) -> float | None:
    """Median over ``epochs`` of (their epoch seconds / ours): our rate over theirs, each
    pair run back to back. ``None`` when no epoch has both."""
    pairs = [theirs[e] / ours[e] for e in epochs if e in ours and e in theirs]
    return float(np.median(pairs)) if pairs else None


def warm_epochs(n: int) -> list[int]:
    """Epochs that count: 2..n (the first carries every path's start-up), or 1 alone."""
    return list(range(2, n + 1)) or [1]


def peer_results(peers: PeerEpochs, missing: Sequence[Unavailable], n_samples: int,
                 sample_nbytes: int, ours: dict[str, dict[int, float]],
                 ) -> list[dict[str, Any]]:
    """One row per peer pass (median of its warm epochs, ratios ours/peer paired per epoch
    for each of ``ours``: label -> epoch seconds), then one per peer that gave no number.
    A peer's better mode (by median, when it ran several) is marked ``best``."""
    rows: list[dict[str, Any]] = []
    for p in peers.passes:
        secs = peers.seconds[p.name]
        warm = [e for e in warm_epochs(max(secs, default=0)) if e in secs]
        median = float(np.median([secs[e] for e in warm]))
        cores = float(np.median([peers.cpu_s[p.name][e] / secs[e] for e in warm]))
        rows.append({
            "name": p.name, "peer": p.peer, "status": "ok", "mode": getattr(p, "mode", None),
            "samples": n_samples, "seconds": median, "samples_per_s": n_samples / median,
            "gb_per_s": n_samples * sample_nbytes / median / 1e9, "cpu_cores": cores,
            "epochs": warm,
            "all_seconds": [secs[e] for e in sorted(secs)],
            "ratios": {label: paired_ratio(o, secs, warm) for label, o in ours.items()},
            "best": False})
    for peer in PEER_NAMES:
        mine = [r for r in rows if r["peer"] == peer]
        if len(mine) > 1:
            min(mine, key=lambda r: r["seconds"])["best"] = True
    rows += [{"name": u.name or u.peer, "peer": u.peer, "status": u.reason, "best": False}
             for u in (*missing, *peers.failed)]
    return rows


def peer_runs(rows: Sequence[dict[str, Any]], sample_nbytes: int) -> list[Run]:
    """The peers that ran, as rows of the main table (their median epoch)."""
    return [Run(r["name"], r["samples"], r["seconds"], sample_nbytes,
                cpu_s=r["cpu_cores"] * r["seconds"],
                extra={"peer": r["peer"], "mode": r["mode"], "all_seconds": r["all_seconds"],
                       "ratio_ours_over_peer": r["ratios"]})
            for r in rows if r["status"] == "ok"]


_RATIO_HEAD = {"per_variable": "ours/peer", "channels": "ours(chan)/peer"}


def _ratio_labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    labels: list[str] = []
    for r in rows:
        labels += [k for k in r.get("ratios", {}) if k not in labels]
    return labels


def format_peers(rows: Sequence[dict[str, Any]], epochs: int) -> str:
    """The peers' table: rate, cores, and ours/peer paired per epoch (> 1: we are faster)."""
    if not rows:
        return "peers: none asked for (--peers none)"
    labels = _ratio_labels(rows)
    warm = warm_epochs(epochs)
    lines = [f"\npeers (local store; every sample of the split once per epoch, in a random "
             f"order; one epoch each right after every loader epoch; median of epochs "
             f"{warm[0]}-{warm[-1]}; ours/peer = median of peer epoch s / loader epoch s "
             "run back to back; * = the peer's best mode):"]
    head = (f"{'path':<46} {'samples/s':>9} {'GB/s':>5} {'cores':>5} "
            + " ".join(f"{_RATIO_HEAD.get(k, k):>14}" for k in labels))
    lines += [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['name']:<46} {r['status']}")
            continue
        name = ("* " if r["best"] else "") + r["name"]
        lines.append(f"{name[:46]:<46} {r['samples_per_s']:>9,.0f} {r['gb_per_s']:>5.2f} "
                     f"{r['cpu_cores']:>5.2f} "
                     + " ".join(f"{fmt(r['ratios'].get(k), '.2f'):>14}" for k in labels))
    return "\n".join(lines)


def format_peers_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The peers' table as Markdown: ``ours/peer`` per loader kind (> 1: we are faster)."""
    labels = _ratio_labels(rows)
    cols = [f"ours ({k.replace('_', '-')}) / peer" for k in labels]
    lines = ["| peer | samples/s | GB/s | cores | " + " | ".join(cols) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(cols)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']} |" + " |" * (2 + len(cols)))
            continue
        name = f"**{r['name']}** (best)" if r["best"] else r["name"]
        lines.append(f"| {name} | {r['samples_per_s']:,.0f} | {r['gb_per_s']:.2f} | "
                     f"{r['cpu_cores']:.2f} | "
                     + " | ".join(fmt(r["ratios"].get(k), ".2f") for k in labels) + " |")
    return "\n".join(lines)
