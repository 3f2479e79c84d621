"""The per-batch stages after the gather, planned before any stage is built: normalise and
cast, static fields, channels stacked after a device gather, patches, channels last.

Planning them first (``transform_plan``) lets ``graph.build_graph`` decide, before any
stage or worker exists, whether the gather may write into ``PinOrCudaNode``'s pinned slots,
and raises a misconfigured transform (a patch bigger than the grid) before the fetch starts.
``SampleDataset`` builds the same stages over batches of one sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torchdata.nodes import BaseNode

from .config import LoaderConfig, SampleConfig
from .errors import ConfigError
from .memory.layout import BatchLayout, Channel
from .memory.staging import StagingSeam
from .nodes import GatherNode, NormalizeNode, TransformNode
from .nodes.channels import StackChannelsNode
from .nodes.patches import PatchNode, patch_origins
from .nodes.static import StaticFieldsNode, check_static
from .nodes.views import ChannelsLastNode
from .store.source import Source
from .store.statistics import Stats, cut_stats


class Resolved(Protocol):
    """What the stages are planned from (``graph.Resolved``, which imports this module)."""

    @property
    def config(self) -> LoaderConfig: ...
    @property
    def layout(self) -> BatchLayout | None: ...
    @property
    def channels(self) -> tuple[Channel, ...] | None: ...
    @property
    def channels_key(self) -> str: ...

@dataclass(frozen=True)
class Stage:
    """A per-batch stage after the gather, before it is built: ``build`` makes it over its
    upstream; ``keeps_batch_memory`` says whether it hands the batch's tensors on in place
    (``TransformNode``), which decides before anything is built whether the gather may
    write into ``PinOrCudaNode``'s pinned slots."""

    build: Callable[[BaseNode], BaseNode]
    keeps_batch_memory: bool


def staging_through(gather: GatherNode, between: Sequence[BaseNode]) -> StagingSeam | None:
    """``gather``'s staging seam for the ``PinOrCudaNode`` after ``between``, if every
    stage between keeps the batch's tensors (else the gather would fill pinned buffers
    that a cast or stacking then leaves unused: the seam stays unattached, and the gather
    allocates its own)."""
    if not all(isinstance(n, TransformNode) and n.keeps_batch_memory for n in between):
        return None
    return gather.staging


def transform_plan(source: Source, resolved: Resolved,
                   device: torch.device | None = None) -> list[Stage]:
    """The per-batch stages after the gather (normalise and cast, static fields, channels
    stacked after a device gather, patches, channels last) as ``resolved`` asks, checked
    against the source before anything is built."""
    sm = resolved.config.sample
    layout, channels = resolved.layout, resolved.channels
    plan: list[Stage] = []
    if (sm.stats is not None or sm.dtype is not None or sm.fill_nan is not None
            or sm.mask):
        # per grid point statistics of the whole store, cut as a region or read group is
        stats = cut_stats(sm.stats, source) if sm.stats is not None else Stats("", ())
        plan.append(Stage(lambda n: NormalizeNode(
            n, stats, source.variables, dtype=sm.dtype, layout=layout, schemes=sm.normalize,
            selection=source.selection, fill_nan=sm.fill_nan, mask=sm.mask),
            NormalizeNode.keeps_memory(sm.dtype)))
    if sm.static:
        check_static(sm.static, {v.name: v.sample_shape for v in source.variables},
                     len(sm.patch_size) if sm.patch_size is not None else 0)
        static = sm.static
        plan.append(Stage(lambda n: StaticFieldsNode(n, static, device=device, dtype=sm.dtype),
                          StaticFieldsNode.keeps_batch_memory))
    if channels and layout is None:
        stacked = channels
        plan.append(Stage(lambda n: StackChannelsNode(n, stacked, key=resolved.channels_key),
                          StackChannelsNode.keeps_batch_memory))
    if sm.patch_size is not None:
        plan.append(_patch_stage(source, sm))
    if sm.channels_last or sm.drop_ensemble:
        plan.append(Stage(lambda n: ChannelsLastNode(n, (resolved.channels_key,),
                                                     -3 if sm.channels_last else None,
                                                     (-2,) if sm.drop_ensemble else ()),
                          ChannelsLastNode.keeps_batch_memory))
    return plan


def _patch_stage(source: Source, sm: SampleConfig) -> Stage:
    """``PatchNode`` for ``sample.patch_size``, its size checked against the samples."""
    assert sm.patch_size is not None
    size = sm.patch_size
    k = len(size)
    short = {v.name: v.sample_shape for v in source.variables if len(v.sample_shape) < k}
    if short:
        raise ConfigError(f"patch_size={tuple(size)} cuts the last {k} dims of "
                         f"each sample, but these samples have fewer: {short}")
    shapes = {v.name: tuple(v.sample_shape[-k:]) for v in source.variables}
    if len(set(shapes.values())) > 1:  # one grid of patches cuts one grid of points
        raise ConfigError(f"patch_size={tuple(size)} cuts every variable on one "
                         f"grid, but their last {k} dims differ: {shapes}; open the "
                         "variables of one grid (open_source(variables=...))")
    spatial = next(iter(shapes.values()))
    # the size checked against the grid here, in the plan, before any worker starts
    # (PatchNode, given the shape, computes its corners once when it is built)
    patch_origins(spatial, size, sm.patch_stride)
    return Stage(lambda n: PatchNode(n, size, sm.patch_stride, spatial_shape=spatial),
                 PatchNode.keeps_batch_memory)


def transform_stages(node: BaseNode, source: Source, resolved: Resolved,
                     device: torch.device | None = None,
                     plan: Sequence[Stage] | None = None) -> tuple[BaseNode, list[BaseNode]]:
    """The stages of ``transform_plan`` (or ``plan``) built over ``node``: (the last stage,
    the stages added). ``SampleDataset`` runs the same stages over batches of one sample,
    so a sample read by index is the loader's row."""
    between: list[BaseNode] = []
    for stage in plan if plan is not None else transform_plan(source, resolved, device):
        node = stage.build(node)
        between.append(node)
    return node, between


