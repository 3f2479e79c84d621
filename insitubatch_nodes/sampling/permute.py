"""Per-epoch chunk order and rank shares: pure functions of (seed, epoch, rank partition)."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

# Distinct stream tags so that the chunk permutation and the in-window draws never share
# random numbers even for equal (seed, epoch).
CHUNK_STREAM = 0xC4
DRAW_STREAM = 0xD7


_WORD = 0xFFFFFFFF  # a key part SeedSequence reads as one uint32 word


def seeded_rng(*key: int) -> np.random.Generator:
    """``np.random.default_rng(np.random.SeedSequence(list(key)))``, a third of the cost.

    SeedSequence turns each part of a list into uint32 words one at a time (~2 us a part,
    paid once a window); a part in ``[0, 2**32)`` is that one word, and a uint32 array is
    taken as it is, so passing the words as one array gives the very same state. A key
    with a larger (or negative) part goes the list's way (same stream, or its error)."""
    if all(0 <= k <= _WORD for k in key):
        entropy: np.ndarray | list[int] = np.array(key, dtype=np.uint32)
    else:
        entropy = list(key)
    # default_rng(SeedSequence) is Generator(PCG64(SeedSequence)), without its checks
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def epoch_chunk_order(chunk_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The split's chunks in this epoch's order; the same for every rank and world size."""
    rng = seeded_rng(CHUNK_STREAM, seed, epoch)
    return np.asarray(chunk_ids, dtype=np.int64)[rng.permutation(len(chunk_ids))]


def rank_share(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Deal the epoch's order to ranks round-robin; shares are disjoint and cover it."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return order[rank::world_size]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Fill in rank/world_size from an initialised torch.distributed group, else 0/1."""
    if rank is not None and world_size is not None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        return int(rank), int(world_size)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        r = dist.get_rank() if rank is None else rank
        w = dist.get_world_size() if world_size is None else world_size
        return resolve_rank(r, w)
    if (rank or 0) != 0 or (world_size or 1) != 1:
        raise ConfigError(
            f"rank={rank}, world_size={world_size} given without the other and no "
            "torch.distributed process group is initialised; give both"
        )
    return 0, 1
