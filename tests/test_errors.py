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


# -- every error raised on purpose is an InsitubatchError and still its builtin ----------
NEW_ERRORS = [("ConfigTypeError", TypeError), ("UnknownNameError", KeyError),
              ("StoreNotFoundError", FileNotFoundError), ("StoreAccessError", PermissionError),
              ("StoreConnectionError", ConnectionError), ("StoreExistsError", FileExistsError),
              ("LocalFileError", OSError), ("SampleIndexError", IndexError),
              ("LoaderUsageError", RuntimeError), ("MissingDependencyError", ImportError),
              ("InternalError", RuntimeError), ("UsageTypeError", TypeError)]


@pytest.mark.parametrize(("name", "builtin"), NEW_ERRORS, ids=[n for n, _ in NEW_ERRORS])
def test_each_error_class_is_exported_and_derives_from_the_base_and_its_builtin(name, builtin):
    err = getattr(ib, name)
    assert name in ib.__all__
    assert issubclass(err, ib.InsitubatchError) and issubclass(err, builtin)


def test_an_unknown_name_prints_its_message_without_keyerrors_quotes():
    assert str(ib.UnknownNameError("unknown split 'nope'")) == "unknown split 'nope'"


def test_an_unknown_split_is_an_unknown_name_error_listing_the_splits(small):
    src, m = small
    for build in (ib.build_loader, ib.SampleDataset):
        with pytest.raises(ib.UnknownNameError, match=r"'nope'.*\['train'\]") as info:
            build(src, m, "nope")
        assert isinstance(info.value, ib.InsitubatchError) and isinstance(info.value, KeyError)


@pytest.mark.parametrize("build", [ib.build_loader, ib.SampleDataset])
def test_manifest_and_split_name_swapped_is_a_config_error_naming_both(small, build):
    src, m = small
    with pytest.raises(ib.ConfigError, match=r"manifest='train'.*split=.*swapped"):
        build(src, "train", m)
    with pytest.raises(ib.ConfigError, match=r"manifest must be a SplitManifest.*str 'train'"):
        build(src, "train", "train")
    with pytest.raises(ib.ConfigError, match=r"split must be the name.*\['train'\].*int 0"):
        build(src, m, 0)


def test_an_unknown_option_is_a_config_type_error_listing_the_options(small):
    src, m = small
    with pytest.raises(ib.ConfigTypeError, match="'batchsize'.*batch_size") as info:
        ib.build_loader(src, m, "train", batchsize=4)
    assert isinstance(info.value, TypeError)
    with pytest.raises(ib.ConfigTypeError, match="sample.dtype"):
        ib.build_loader(src, m, "train", dtype="float16")


def test_a_loader_used_after_shutdown_says_shutdown_not_close(small):
    src, m = small
    loader = ib.build_loader(src, m, "train", batch_size=4)
    it = iter(loader)
    next(it)
    loader.shutdown()
    for use in (lambda: next(iter(loader)), lambda: next(it)):
        with pytest.raises(ib.LoaderUsageError, match=r"was shut down \(loader.shutdown\(\)") \
                as info:
            use()
        assert isinstance(info.value, RuntimeError)
        assert "close() and the end of a with block only pause it" in str(info.value)


def test_a_closed_loader_restarts_where_a_shut_down_one_refuses(small):
    src, m = small
    loader = ib.build_loader(src, m, "train", batch_size=4)
    with loader:
        first = [b["sample_index"].tolist() for b in loader]
    assert [b["sample_index"].tolist() for b in loader] != [] and first
    loader.shutdown()
    with pytest.raises(ib.LoaderUsageError):
        iter(loader)


def test_store_errors_keep_their_builtin(small, tmp_path):
    with pytest.raises(ib.StoreNotFoundError) as info:
        ib.open_source(tmp_path / "missing.zarr")
    assert isinstance(info.value, FileNotFoundError)
    src, _ = small
    with pytest.raises(ib.UnknownNameError, match="'nope'") as unknown:
        src.variable("nope")
    assert isinstance(unknown.value, KeyError)


def test_sample_dataset_positions_and_names(small):
    src, m = small
    ds = ib.SampleDataset(src, m, "train")
    with pytest.raises(ib.SampleIndexError, match="out of range") as info:
        ds[len(ds)]
    assert isinstance(info.value, IndexError)
    with pytest.raises(ib.ConfigTypeError):
        ds["0"]
    with pytest.raises(ib.UnknownNameError, match="not in split"):
        ds.index_of(10**6)


def test_a_cuda_device_without_cuda_is_a_usage_error(small):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    src, m = small
    with pytest.raises(ib.LoaderUsageError, match="no usable CUDA") as info:
        ib.build_loader(src, m, "train", device="cuda")
    assert isinstance(info.value, RuntimeError)


# Raised by the language's protocols, not as this package's errors: the end of an iterator,
# an exit status, an abstract method, memory the allocator refused; AttributeError is
# checked apart (only __getattr__ may). A broken invariant is an ib.InternalError.
_PROTOCOL = {"StopIteration", "StopAsyncIteration", "SystemExit", "KeyboardInterrupt",
             "GeneratorExit", "NotImplementedError", "MemoryError"}


def _builtin_errors_raised(tree, name: str):
    import ast
    import builtins

    def walk(node, func: str):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) \
                else func
            made = None
            if isinstance(child, ast.Raise) and child.exc is not None:
                made = child.exc
            elif isinstance(child, ast.Return) and isinstance(child.value, ast.Call):
                made = child.value
            if made is not None:
                target = made.func if isinstance(made, ast.Call) else made
                cls = getattr(builtins, target.id, None) if isinstance(target, ast.Name) \
                    else None
                if (isinstance(cls, type) and issubclass(cls, BaseException)
                        and target.id not in _PROTOCOL
                        and not (target.id == "AttributeError" and func == "__getattr__")):
                    yield f"{name}:{child.lineno} {target.id}"
            yield from walk(child, inner)

    yield from walk(tree, "")


def test_the_package_raises_no_bare_builtin_error():
    """Every error raised (or made to be raised) on purpose is an InsitubatchError: a
    ``raise ValueError(...)`` anywhere in the package fails here, naming file and line."""
    import ast
    from pathlib import Path

    pkg = Path(ib.__file__).parent
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent).as_posix()
        bad += _builtin_errors_raised(ast.parse(path.read_text()), rel)
    assert not bad, "raise an ib.InsitubatchError subclass instead:\n" + "\n".join(bad)
