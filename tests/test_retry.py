"""Which read failures are retried, how they are counted, and the error that ends a read."""

import errno
import pickle

import numpy as np
import obstore.exceptions as oe
import obstore.store
import pytest
import zarr
import zarr.storage
from stores import BLOSC, Var, write_store

import insitubatch_nodes as ib
from insitubatch_nodes.io.read_paths import ObjectStoreGets
from insitubatch_nodes.io.reader import StripeReader
from insitubatch_nodes.io.retry import (
    ChunkDecodeError,
    ChunkReadError,
    CorruptChunkError,
    classify,
    http_status,
)

NO_WAIT = ib.RetryPolicy(attempts=5, base_delay=0.0, decode_attempts=3)


def _generic(status: str) -> oe.GenericError:
    """obstore's error for an HTTP failure, worded as object_store words it."""
    return oe.GenericError(
        "Generic S3 error: Error performing GET http://127.0.0.1:9/data/x/c/0/0 in 14ms, after "
        f"3 retries, max_retries: 3, retry_timeout: 30s  - Server returned non-2xx status code: "
        f"{status}: <?xml version=\"1.0\"?><Error><Code>X</Code><Message>status code: 400"
        "</Message></Error>")


@pytest.mark.parametrize("exc,kind", [
    (ChunkDecodeError("zstd: invalid input data"), "decode"),
    (_generic("503 Service Unavailable"), "transient"),
    (_generic("500 Internal Server Error"), "transient"),
    (_generic("429 Too Many Requests"), "transient"),
    (_generic("400 Bad Request"), "permanent"),
    (oe.GenericError("Generic S3 error: HTTP error: request or response body error"),
     "transient"),
    (oe.PermissionDeniedError("denied"), "permanent"),
    (oe.UnauthenticatedError("no"), "permanent"),
    (oe.JoinError("panicked"), "permanent"),
    (ConnectionResetError("reset"), "transient"),
    (TimeoutError("slow"), "transient"),
    (OSError(errno.EIO, "Input/output error"), "transient"),
    (OSError("obstore IO error without errno"), "transient"),
    (FileNotFoundError("gone"), "permanent"),
    (PermissionError(errno.EACCES, "no"), "permanent"),
    (OSError(errno.EINVAL, "bad argument"), "permanent"),
    (ValueError("a bug of ours"), "permanent"),
    (RuntimeError("a bug of ours"), "permanent"),
    (TypeError("a bug of ours"), "permanent"),
    (KeyError("k"), "permanent"),
])
def test_only_errors_known_to_be_transient_are_retried(exc, kind):
    assert classify(exc) == kind


def test_http_status_comes_from_the_type_or_object_stores_phrase():
    assert http_status(oe.PermissionDeniedError("x")) == 403
    assert http_status(oe.UnauthenticatedError("x")) == 401
    # the first match, before the response body (whose text says "status code: 400")
    assert http_status(_generic("503 Service Unavailable")) == 503
    assert http_status(oe.GenericError("HTTP error: error sending request")) is None
    # text is read only for GenericError: a " 403 " elsewhere is not a status
    assert http_status(ValueError("got 403 rows, status code: 403")) is None


def test_chunk_read_errors_stay_catchable_and_pickle():
    err = CorruptChunkError("chunk 'x/c/1/0' ...", "file:///s.zarr", "x", "x/c/1/0", 3)
    assert isinstance(err, ValueError) and isinstance(err, OSError)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.key, back.attempts) == (
        CorruptChunkError, str(err), "x/c/1/0", 3)


# -- through the loader and the reader -------------------------------------------------------

def test_a_corrupt_chunk_is_named_in_the_message_and_its_retries_counted(corrupt):
    src, m = corrupt
    loader = ib.build_loader(src, m, "train", batch_size=4, block_chunks=2, retry=NO_WAIT)
    with pytest.raises(CorruptChunkError) as info:
        for _ in loader:
            pass
    err = info.value
    text = str(err)  # the message itself, not a note
    assert src.url in text and "'x'" in text and "'x/c/5/0'" in text, text
    assert "3 attempts" in text and "blosc frame is damaged" in text, text
    assert (err.url, err.variable, err.key, err.attempts) == (src.url, "x", "x/c/5/0", 3)
    assert isinstance(err, ValueError)  # as the codec's error was
    assert isinstance(err.__cause__, ChunkDecodeError)
    assert isinstance(err.__cause__.__cause__, ValueError)  # the frame check's own error
    assert loader.stats().retries == 2  # attempts 2 and 3
    loader.close()


def _read(src, index, retry):
    """Stripe ``index`` of the first variable through a StripeReader, on a fresh loop."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    reader = StripeReader(src.arrays[0], src.variables[0], src.url)
    out = np.empty(src.variables[0].stripe_shape, src.variables[0].dtype)
    loop, pool = asyncio.new_event_loop(), ThreadPoolExecutor(1)
    try:
        return reader, loop.run_until_complete(reader.read(index, out, loop, pool, retry))
    finally:
        loop.close()
        pool.shutdown()


@pytest.mark.parametrize("error", [TypeError("bug: wrong argument"),
                                   ValueError("bug: not about the bytes")])
def test_a_programming_error_is_not_retried_and_keeps_its_type(tmp_path, monkeypatch, error):
    write_store(tmp_path / "s.zarr", [Var("x", (16, 4), (8, 4), compressors=BLOSC)])
    src = ib.open_source(tmp_path / "s.zarr")
    calls = []

    def broken(self, data, inner, out):
        calls.append(inner)
        raise error

    monkeypatch.setattr(StripeReader, "place", broken)
    with pytest.raises(type(error)) as info:
        _read(src, 1, NO_WAIT)
    assert info.value is error and not isinstance(info.value, ChunkReadError)
    assert len(calls) == 1
    assert any("not retried" in n and "'x'" in n for n in info.value.__notes__)


def test_a_codec_error_inside_the_decoder_is_a_decode_error(tmp_path, monkeypatch):
    """Bytes that do not decode are retried a little (a transfer may have been cut short):
    decode_attempts tries, then the chunk is named as corrupt."""
    from insitubatch_nodes.io.decode import ChunkDecoder

    write_store(tmp_path / "s.zarr", [Var("x", (16, 4), (8, 4), compressors=BLOSC)])
    src = ib.open_source(tmp_path / "s.zarr")
    calls = []

    def damaged(self, data, out):
        calls.append(1)
        raise RuntimeError("error during blosc decompression: -1")

    monkeypatch.setattr(ChunkDecoder, "_decode_into", damaged)
    with pytest.raises(CorruptChunkError, match=r"'x/c/1/0' of variable 'x' .* 3 attempts"):
        _read(src, 1, NO_WAIT)
    assert len(calls) == 3


def _object_source():
    """A store read on the "object" path (obstore's async get), in memory."""
    mem = obstore.store.MemoryStore()
    g = zarr.open_group(zarr.storage.ObjectStore(mem), mode="w")
    g.create_array("x", shape=(16, 3), chunks=(4, 3), dtype="float32")[:] = \
        np.arange(48, dtype="float32").reshape(16, 3)
    src = ib.open_source(zarr.open_group(zarr.storage.ObjectStore(mem, read_only=True), mode="r"))
    return src, np.arange(48, dtype="float32").reshape(16, 3)


def test_an_obstore_transient_error_is_retried_and_counted(monkeypatch):
    src, data = _object_source()
    real = ObjectStoreGets.get
    failures = {"x/c/2/0": 2}

    async def flaky(self, key):
        if failures.get(key, 0) > 0:
            failures[key] -= 1
            raise _generic("503 Service Unavailable")
        return await real(self, key)

    monkeypatch.setattr(ObjectStoreGets, "get", flaky)
    loader = ib.build_loader(src, ib.split_by_chunk(src, (1.0,)), "train", batch_size=4,
                             retry=NO_WAIT)
    assert loader.node(ib.AsyncFetchNode).readers[0].mode == "object"
    rows = {int(i): b["x"][k].numpy() for b in loader for k, i in enumerate(b["sample_index"])}
    assert sorted(rows) == list(range(16))
    np.testing.assert_array_equal(np.stack([rows[i] for i in range(16)]), data)
    assert loader.stats().retries == 2 and failures["x/c/2/0"] == 0
    loader.close()


def test_an_obstore_client_error_is_not_retried_and_names_the_chunk(monkeypatch):
    src, _ = _object_source()
    calls = []

    async def refused(self, key):
        calls.append(key)
        raise _generic("400 Bad Request")

    monkeypatch.setattr(ObjectStoreGets, "get", refused)
    with pytest.raises(ChunkReadError) as info:
        _read(src, 3, NO_WAIT)
    text = str(info.value)
    assert "'x/c/3/0'" in text and "'x'" in text and src.url in text and "1 attempt" in text
    assert "400 Bad Request" in text and "<?xml" not in text  # no response body
    assert isinstance(info.value.__cause__, oe.GenericError)
    assert calls == ["x/c/3/0"]  # one attempt


@pytest.mark.parametrize("message,kept", [
    ("HTTP 403: <?xml version='1.0'?><Error><Code>AccessDenied</Code>", "HTTP 403"),
    ("Forbidden <Error xmlns='http://s3'><Code>x</Code></Error>", "Forbidden"),
    ("gateway: <!DOCTYPE html><html>secret", "gateway"),
    ("chunk dtype <f4 does not match >f8", "chunk dtype <f4 does not match >f8"),
])
def test_a_message_loses_its_response_body_but_not_its_dtypes(message, kept):
    from insitubatch_nodes.io.reader import _summary

    assert _summary(ValueError(message)) == kept
