"""Shuffle quality: how close the two-level shuffle comes to a true global shuffle.

Score = expected distinct chunks touched by one batch under our scheme, divided by the same
under a uniform shuffle of the whole split. 1.0 is a global shuffle; it rises with
``block_chunks`` (more chunks mixed per window) and is measured as well as modelled.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError


def _expected_distinct(n_chunks: int, chunk_size: int, batch_size: int) -> float:
    """E[distinct chunks] for a batch drawn without replacement from n_chunks full chunks."""
    n = n_chunks * chunk_size
    b = min(batch_size, n)
    if n_chunks <= 0 or b <= 0:
        return 0.0
    if b > n - chunk_size:
        return float(n_chunks)
    # P(a given chunk is untouched) = C(n - s, b) / C(n, b), hypergeometric.
    log_p = (math.lgamma(n - chunk_size + 1) - math.lgamma(n - chunk_size - b + 1)
             - math.lgamma(n + 1) + math.lgamma(n - b + 1))
    return n_chunks * (1.0 - math.exp(log_p))


def shuffle_quality(n_chunks: int, chunk_size: int, block_chunks: int, batch_size: int) -> float:
    """Modelled score in (0, 1] for a split of ``n_chunks`` chunks of ``chunk_size`` samples."""
    if min(n_chunks, chunk_size, block_chunks, batch_size) < 1:
        raise ConfigError("n_chunks, chunk_size, block_chunks and batch_size must all be >= 1")
    window = min(block_chunks, n_chunks)
    ideal = _expected_distinct(n_chunks, chunk_size, batch_size)
    if batch_size >= window * chunk_size:
        # The batch spans whole windows (and so all of their chunks).
        ours = batch_size / chunk_size
    else:
        ours = _expected_distinct(window, chunk_size, batch_size)
    return 1.0 if ideal == 0 else min(1.0, ours / ideal)


def measured_shuffle_quality(batches_sample_index: list[np.ndarray], chunk_size: int,
                             n_chunks: int) -> float:
    """Score measured from real batches (their ``sample_index``), full-size batches only.
    With time steps, samples of one run are neighbours in time: pass the run's samples
    (``loader.run_chunks * chunk_size``) and the number of runs as the unit."""
    sizes = [len(b) for b in batches_sample_index]
    if not sizes:
        raise ConfigError("no batches to measure")
    full = max(sizes)
    distinct = [np.unique(np.asarray(b) // chunk_size).size
                for b in batches_sample_index if len(b) == full]
    return float(np.mean(distinct)) / _expected_distinct(n_chunks, chunk_size, full)


def recommend_block_chunks(n_chunks: int, chunk_size: int, batch_size: int, quality: float,
                           max_block_chunks: int | None = None) -> int:
    """Smallest ``block_chunks`` whose modelled score reaches ``quality`` (capped)."""
    cap = n_chunks if max_block_chunks is None else max(1, min(n_chunks, max_block_chunks))
    lo, hi = 1, cap
    if shuffle_quality(n_chunks, chunk_size, hi, batch_size) < quality:
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if shuffle_quality(n_chunks, chunk_size, mid, batch_size) >= quality:
            hi = mid
        else:
            lo = mid + 1
    return lo
