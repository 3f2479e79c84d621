"""One error base: what the package raises on purpose is an ``ib.InsitubatchError`` and
still the builtin callers caught before (ValueError, OSError, RuntimeError)."""

import pytest
from stores import Var

import insitubatch_nodes as ib


@pytest.fixture
def small(store_factory):
    path, _ = store_factory([Var("x", (40, 3), (4, 3))])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,))


def test_the_specific_errors_derive_from_the_base_and_their_builtin():
    for err, builtin in [(ib.ConfigError, ValueError), (ib.StoreError, ValueError),
                         (ib.StateError, ValueError), (ib.ChunkReadError, OSError),
                         (ib.CorruptChunkError, ValueError), (ib.WorkerError, RuntimeError)]:
        assert issubclass(err, ib.InsitubatchError) and issubclass(err, builtin), err


def test_a_bad_option_is_a_config_error_naming_it(small):
    src, m = small
    with pytest.raises(ib.ConfigError, match="batch_size") as info:
        ib.build_loader(src, m, "train", batch_size=0)
    assert isinstance(info.value, ValueError)


def test_a_bad_split_is_a_store_error(small):
    src, _ = small
    with pytest.raises(ib.StoreError, match="fractions"):
        ib.split_by_chunk(src, (0.7, 0.7))


def test_a_state_that_does_not_match_is_a_state_error_naming_the_field(small):
    src, m = small
    with ib.build_loader(src, m, "train", batch_size=4, seed=1) as ld:
        next(iter(ld))
        state = ld.state_dict()
    with ib.build_loader(src, m, "train", batch_size=4, seed=2) as other, \
            pytest.raises(ib.StateError, match="seed"):
        other.load_state_dict(state)
    with ib.build_loader(src, m, "train", batch_size=4, seed=1) as same, \
            pytest.raises(ib.InsitubatchError, match="a dict"):
        same.load_state_dict([1, 2])
