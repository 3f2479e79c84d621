"""A deal that serves every rank: the checks ``graph.resolve`` makes of a world size and a
batch size against a split's schedule, and the schedule's modelled shuffle quality.

Pure index math over the schedule (no store is read), so a configuration that would leave
a rank (or a model group) nothing is refused at build, naming what would fit.
"""

from __future__ import annotations

from ..errors import ConfigError
from .grid_parts import Deal
from .quality import shuffle_quality
from .schedule import ScheduleContext, n_units, rank_schedule


def groups_text(deal: Deal) -> str:
    """How an error names the ranks samples are dealt to: ``world_size=W``, or with reader
    groups the model groups they make."""
    if deal.read_group == 1:
        return f"world_size={deal.world_size}"
    return (f"world_size={deal.world_size} in model groups of read_group={deal.read_group} "
            f"({deal.groups} groups)")


def check_world_size(ctx: ScheduleContext, deal: Deal, split: str) -> int:
    """The units (chunks, or blocks of runs) the schedule deals out; fewer than ranks (model
    groups) is an error, since a chunk is served by one rank (group)."""
    units = n_units(ctx)
    if deal.groups > units:
        fewer = (f"{units} ranks" if deal.read_group == 1 else
                 f"{units} model groups ({units * deal.read_group} ranks)")
        raise ConfigError(
            f"{groups_text(deal)} exceeds the {units} "
            f"{'blocks' if ctx.contiguous else 'chunks'} of split {split!r}: a chunk "
            f"is served by one {'rank' if deal.read_group == 1 else 'model group'}, so some "
            f"would get nothing. Use at most {fewer}, or a split with more chunks."
        )
    return units


def check_batches(ctx: ScheduleContext, deal: Deal, split: str, batch_size: int,
                   drop_last: bool) -> None:
    """Refuse a split that yields this rank no batch in an epoch (fewer samples than
    ``batch_size`` with ``drop_last``, or none): an epoch that yields nothing, without a
    word, is a training loop that silently does nothing. Counted as ``len(loader)``
    counts, on this rank's (model group's) share of the first epoch (exactly, whenever it
    could be short)."""
    rank, world_size = deal.group, deal.groups
    total = ctx.grid.n_samples_of(ctx.chunk_ids)
    window = ctx.block_chunks * ctx.grid.chunk_size
    if total // world_size >= 2 * (batch_size + window):
        return  # every rank's share is far above a batch, however the windows are dealt
    share = rank_schedule(ctx, 0, rank, world_size).target
    if share >= (batch_size if drop_last else 1):
        return
    who = (f"rank {rank} of {world_size}" if deal.read_group == 1 else
           f"model group {rank} of {world_size} (rank {deal.rank}, read_group="
           f"{deal.read_group})")
    ranks = f" ({who} gets {share})" if world_size > 1 else ""
    if share == 0:
        raise ConfigError(f"split {split!r} ({total} samples) yields {who} no sample in an "
                          "epoch: use fewer ranks, or uneven='pad' (equal shares)")
    raise ConfigError(
        f"split {split!r} yields no batch: its {total} samples{ranks} make no batch of "
        f"batch_size={batch_size} with drop_last=True; use batch_size <= {share}, "
        f"or drop_last=False (one batch of {share})")


def schedule_quality(ctx: ScheduleContext, chunk_size: int, units: int,
                     batch_size: int) -> float:
    """The modelled shuffle quality of the schedule ``ctx`` (``chunk_size``: the store's
    samples a chunk, ``units``: what it deals out)."""
    if ctx.contiguous:
        # mixing is over runs: samples of one run are neighbours in time, so a batch of
        # them is as correlated as a batch of one chunk
        return shuffle_quality(units, ctx.run_length * chunk_size, ctx.runs_per_window,
                               batch_size)
    return shuffle_quality(len(ctx.chunk_ids), chunk_size, ctx.block_chunks, batch_size)
