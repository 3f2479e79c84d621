"""What options left to the loader become (defaults.py): the cores it sizes itself for."""

import pytest

from insitubatch_nodes import defaults
from insitubatch_nodes.errors import ConfigError


def test_cores_from_the_environment(monkeypatch):
    monkeypatch.setattr(defaults, "WORKERS_FROM_CORES", 4)  # conftest turns "auto" off
    monkeypatch.setenv(defaults.CORES_ENV, "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert defaults.cores_per_rank() == 8
    assert defaults.default_workers(True) == 7
    assert defaults.default_workers(False) == 0  # decode="gpu" / in_place=False: threads


@pytest.mark.parametrize("bad", ["0", "-2", "four"])
def test_a_bad_core_count_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(defaults.CORES_ENV, bad)
    with pytest.raises(ConfigError, match=rf"INSITUBATCH_CORES={bad!r}.*whole number"):
        defaults.cores_per_rank()
