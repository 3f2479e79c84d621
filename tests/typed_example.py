"""What a user's type checker knows of a loader: ``tests/test_typing.py`` checks this file
with mypy (never run; pytest collects nothing from it).

``assert_type`` fails the check unless the checker infers exactly that type (``Any``
included): the batches a loader yields are ``dict[str, torch.Tensor]``.
"""

from __future__ import annotations

from typing import assert_type

import torch

import insitubatch_nodes as ib


def first_batch(url: str) -> dict[str, torch.Tensor]:
    source = ib.open_source(url, ["t2m"])
    assert_type(source, ib.Source)
    manifest = ib.split_by_chunk(source, fractions=(0.8, 0.2), seed=0)
    with ib.build_loader(source, manifest, "train", batch_size=16, seed=0) as loader:
        assert_type(loader, ib.InSituLoader)
        batch: dict[str, torch.Tensor] = next(iter(loader))
        assert_type(next(iter(loader)), dict[str, torch.Tensor])
        for b in loader:
            assert_type(b, dict[str, torch.Tensor])
            assert_type(b["t2m"], torch.Tensor)
    return batch
