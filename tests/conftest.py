"""Shared fixtures: real zarr stores on disk, filled with data we can check rows against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stores import Var, write_store


@pytest.fixture

def store_factory(tmp_path: Path):
    counter = iter(range(10**6))

    def make(variables: list[Var], seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
        path = tmp_path / f"store{next(counter)}.zarr"
        return path, write_store(path, variables, seed)

    return make

