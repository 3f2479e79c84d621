"""What ``insitubatch bench`` measures (``CoreConfig``), and the split it measures on.

Its own module so the paths timed beside the loader (floors, loader epochs, first batches)
and the run that drives them share one config without importing each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import BELUGA_MODES, PEER_NAMES
from .common import LoaderSettings

SPLIT = "train"
CHANNELS_LABEL = "insitubatch loader, channels"
RSS_SLACK = 400 * 10**6  # target: peak RSS <= resident bound + this


@dataclass(frozen=True)
class CoreConfig(LoaderSettings):
    """What ``run_core`` measures; the CLI fills it from its options."""

    epochs: int = 5
    naive_samples: int = 1500
    naive_workers: tuple[int, ...] = (0, 2)
    floor_threads: int = field(default_factory=lambda: min(4, os.cpu_count() or 2))
    repeats: int = 3
    split_fraction: float = 1.0
    resume_after: int = 10
    out_dir: Path = Path("bench-out")
    json_name: str = "core.json"
    plots: bool = True
    progress: bool = True
    channels: tuple[str, ...] = ()  # also run the loader stacking these into "channels"
    peers: tuple[str, ...] = PEER_NAMES
    beluga_modes: tuple[str, ...] = BELUGA_MODES
