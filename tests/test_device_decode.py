"""The device decode path (``decode=``) gives the CPU path's batches, bit for bit.

On machines without CUDA the whole path (frame checks, window packing, batched decode
calls, stripe assembly, torch gather, fallbacks, resume) runs with ``HostFrameDecoder``;
on a CUDA machine with ``nvidia-nvcomp-cu12`` the same tests also run with ``decode="gpu"``.
"""

import json
import logging

import numcodecs
import numpy as np
import pytest
import torch
import zarr
import zarr.codecs as zc
from stores import BLOSC, Var

import insitubatch_nodes as ib
from insitubatch_nodes.io.device_decode import gpu_decode_available
from insitubatch_nodes.testing.host_frames import HostFrameDecoder

DECODERS = ["host", pytest.param("nvcomp", marks=pytest.mark.skipif(
    not gpu_decode_available(),
    reason="needs CUDA and nvidia-nvcomp (extra gpu-cu12 or gpu-cu13)"))]


def options(which):
    """build_loader keywords for one decoder, and the device its tensors live on."""
    if which == "host":
        return dict(decode=HostFrameDecoder()), torch.device("cpu")
    return dict(decode="gpu", device="cuda"), torch.device("cuda", torch.cuda.current_device())


def ran_on_device(loader):
    """The device path really decoded windows (with the host stand-in, the tensors' device
    alone cannot tell)."""
    wd = loader.node(ib.AsyncFetchNode).window_decoder
    return wd is not None and wd.windows > 0 and wd.bytes_out > 0


def epoch(loader):
    return [{k: v.cpu().numpy().copy() for k, v in b.items()} for b in loader]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype, k
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


V2 = dict(zarr_format=2)
CASES = {
    "zstd": [Var("a", (37, 5, 6), (8, 5, 6), compressors=zc.ZstdCodec(level=3))],
    "gzip": [Var("a", (37, 5, 6), (8, 5, 6), compressors=zc.GzipCodec())],
    "raw": [Var("a", (37, 5, 6), (8, 5, 6), compressors=None)],
    "inner-chunks-padded": [Var("a", (37, 5, 6), (8, 2, 4), compressors=zc.ZstdCodec())],
    "one-sample-per-chunk": [Var("a", (19, 4, 4), (1, 4, 4), compressors=zc.ZstdCodec())],
    "dtypes": [Var("h", (37, 5), (8, 5), dtype="float16", compressors=zc.ZstdCodec()),
               Var("i", (37, 5), (8, 5), dtype="int32", compressors=zc.GzipCodec()),
               Var("u", (37, 5), (8, 5), dtype="uint8", compressors=None),
               Var("b", (37, 5), (8, 5), dtype="bool", compressors=zc.ZstdCodec()),
               Var("d", (37,), (4,), dtype="float64", compressors=zc.ZstdCodec()),
               Var("w", (37, 5), (8, 5), dtype="uint16", compressors=zc.ZstdCodec()),
               Var("q", (37, 5), (8, 2), dtype="uint32", compressors=zc.GzipCodec(),
                   extra={"fill_value": 7})],
    "v2": [Var("l", (37, 5), (8, 5), compressors=numcodecs.LZ4(), **V2),
           Var("z", (37, 5), (8, 5), compressors=numcodecs.Zstd(), **V2),
           Var("g", (37, 5), (8, 5), compressors=numcodecs.GZip(), **V2),
           Var("r", (37, 5), (8, 5), compressors=None, **V2)],
    "blosc": [Var("a", (37, 50, 6), (8, 50, 6), compressors=BLOSC),
              Var("b", (37, 300), (8, 300), dtype="float64",
                  compressors=zc.BloscCodec(cname="lz4", shuffle="shuffle")),
              Var("c", (37, 40), (8, 40), dtype="int16",
                  compressors=zc.BloscCodec(cname="lz4hc", shuffle="noshuffle")),
              Var("d", (37, 200), (8, 200), compressors=zc.BloscCodec(cname="zstd", clevel=0)),
              Var("e", (37, 64), (8, 64), dtype="uint8",
                  compressors=zc.BloscCodec(cname="lz4", shuffle="shuffle")),
              Var("h", (37, 400), (8, 400), dtype="uint8",
                  compressors=zc.BloscCodec(cname="zstd", shuffle="bitshuffle")),
              Var("i", (37, 300), (8, 300), dtype="float32",
                  compressors=zc.BloscCodec(cname="lz4", shuffle="bitshuffle")),
              # 7 x 333 = 2331 elements per block, not a multiple of 8: stored unshuffled
              Var("j", (37, 333), (7, 333), dtype="int16",
                  compressors=zc.BloscCodec(cname="zstd", shuffle="bitshuffle")),
              Var("f", (37, 50, 6), (8, 20, 4), compressors=BLOSC),
              ],
    "v2-blosc": [Var("l", (37, 300), (8, 300), compressors=numcodecs.Blosc("lz4", 5, 1),
                     **V2),
                 Var("z", (37, 300), (8, 300), dtype="float64", **V2,
                     compressors=numcodecs.Blosc("zstd", 3, 0))],
    "mixed-with-fallbacks": [Var("z", (37, 5, 6), (8, 5, 6), compressors=zc.ZstdCodec()),
                             Var("x", (37, 5), (4, 5), compressors=zc.BloscCodec(
                                 cname="blosclz", shuffle="shuffle")),
                             Var("s", (37, 5, 6), (4, 5, 3), shards=(8, 5, 6))],
}


@pytest.mark.parametrize("which", DECODERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_batches_equal_the_cpu_path(store_factory, case, which):
    path, data = store_factory(CASES[case])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    kw, dev = options(which)
    ref = ib.build_loader(src, m, "train", batch_size=6, block_chunks=3, seed=3)
    got = ib.build_loader(src, m, "train", batch_size=6, block_chunks=3, seed=3, **kw)
    for _ in range(2):  # two epochs: a new order each, same on both paths
        want = epoch(ref)
        batches = list(got)
        same([{k: v.cpu().numpy() for k, v in b.items()} for b in batches], want)
    on_device = {v.name for v in src.variables} - ({"x", "s"} if case.startswith("mixed")
                                                   else set())
    for name in on_device:
        assert batches[0][name].device == dev, name
    chains = got.node(ib.AsyncFetchNode).window_decoder.chains
    assert {src.variables[v].name for v in chains} == on_device
    assert ran_on_device(got)
    rows = np.concatenate([b["sample_index"] for b in want])
    assert sorted(rows.tolist()) == list(range(src.grid.n_samples))
    for name, d in data.items():  # and the rows are the stored rows
        np.testing.assert_array_equal(
            np.concatenate([b[name] for b in want]), d[rows], err_msg=name)


@pytest.mark.parametrize("which", DECODERS)
def test_missing_chunks_read_as_the_fill_value(tmp_path, which):
    g = zarr.open_group(tmp_path / "s.zarr", mode="w")
    a = g.create_array("a", shape=(30, 4), chunks=(8, 2), dtype="int32", fill_value=-7,
                       compressors=zc.ZstdCodec())
    a[0:8] = 1  # most chunks never written
    a[16:24, 2:4] = 5
    src = ib.open_source(tmp_path / "s.zarr")
    m = ib.split_by_chunk(src, (1.0,))
    kw, _ = options(which)
    loader = ib.build_loader(src, m, "train", batch_size=4, **kw)
    batches = epoch(loader)
    rows = np.concatenate([b["sample_index"] for b in batches])
    np.testing.assert_array_equal(np.concatenate([b["a"] for b in batches]), a[:][rows])
    assert ran_on_device(loader)


def test_one_batched_decode_per_codec_per_window(store_factory):
    path, _ = store_factory([Var("z", (48, 3), (4, 3), compressors=zc.ZstdCodec()),
                             Var("g", (48, 3), (8, 3), compressors=zc.GzipCodec()),
                             Var("r", (48, 3), (8, 3), compressors=None)])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    dec = HostFrameDecoder()
    loader = ib.build_loader(src, m, "train", batch_size=5, block_chunks=2, decode=dec,
                             prefetch_next_epoch=False)  # one epoch's decodes
    epoch(loader)
    windows = 6 // 2  # 6 grid chunks of 8 samples, 2 per window
    assert sorted(dec.calls) == sorted([("zstd", 4)] * windows + [("gzip", 2)] * windows)
    wd = loader.node(ib.AsyncFetchNode).window_decoder
    assert wd.windows == windows and wd.bytes_out == 3 * 48 * 3 * 4  # every stripe, decoded
    assert loader.stats().decode_s > 0  # the device thread's time shows in the metrics


@pytest.mark.parametrize("which", DECODERS)
def test_time_windows_equal_the_cpu_path(store_factory, which):
    path, _ = store_factory([Var("a", (50, 3, 4), (6, 3, 4), compressors=zc.ZstdCodec()),
                             Var("b", (50, 2), (4, 2), compressors=zc.GzipCodec())])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    kw, _ = options(which)
    w = ib.SampleWindow(2, (1, 3))
    loader = ib.build_loader(src, m, "train", batch_size=7, steps=w, block_chunks=2, **kw)
    same(epoch(loader),
         epoch(ib.build_loader(src, m, "train", batch_size=7, steps=w, block_chunks=2)))
    assert ran_on_device(loader)


@pytest.mark.parametrize("which", DECODERS)
@pytest.mark.parametrize("k", [0, 3, 7])
def test_resume_is_exact(store_factory, which, k):
    path, _ = store_factory([Var("a", (61, 3), (4, 3), compressors=zc.ZstdCodec()),
                             Var("x", (61, 2), (8, 2), compressors=BLOSC)])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    kw, _ = options(which)
    full = epoch(ib.build_loader(src, m, "train", batch_size=5, block_chunks=3, seed=1))
    run = ib.build_loader(src, m, "train", batch_size=5, block_chunks=3, seed=1, **kw)
    it = iter(run)
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(run.state_dict()))
    kw2, _ = options(which)
    resumed = ib.build_loader(src, m, "train", batch_size=5, block_chunks=3, seed=1, **kw2)
    resumed.load_state_dict(state)
    same(epoch(resumed), full[k:])
    assert ran_on_device(resumed)


def test_fallbacks_are_logged_once_per_variable_with_the_reason(store_factory, caplog):
    path, _ = store_factory([Var("z", (20, 3), (4, 3), compressors=zc.ZstdCodec()),
                             Var("x", (20, 3), (4, 3), compressors=zc.BloscCodec(
                                 cname="blosclz", shuffle="bitshuffle")),
                             Var("c", (20, 3), (4, 3),
                                 compressors=zc.ZstdCodec(checksum=True))])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    with caplog.at_level(logging.WARNING, logger="insitubatch_nodes"):
        loader = ib.build_loader(src, m, "train", batch_size=4, decode=HostFrameDecoder())
        epoch(loader)
        epoch(loader)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert any("'x'" in s and "blosclz" in s and "bytes -> blosc" in s for s in lines)
    assert any("'c'" in s and "checksum" in s for s in lines)


def test_a_damaged_chunk_is_an_error_naming_its_key(store_factory):
    path, _ = store_factory([Var("a", (32, 50), (8, 50), compressors=zc.ZstdCodec())])
    chunk = path / "a" / "c" / "2" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-5])  # truncated, as by a broken transfer
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=4, decode=HostFrameDecoder(),
                             retry=ib.RetryPolicy(attempts=2, base_delay=0.0))
    it = iter(loader)
    with pytest.raises(ValueError) as err:
        for _ in range(20):
            next(it)
    text = str(err.value) + "\n".join(getattr(err.value, "__notes__", []))
    assert "a/c/2/0" in text and "zstd frame" in text
    with pytest.raises(ValueError):  # and again on the next call, not a silent stop
        next(it)


def test_bitshuffled_blocks_not_a_multiple_of_8_stay_as_stored(store_factory):
    """c-blosc bit-shuffles only blocks of 8k elements: a 7 x 333 int16 chunk (2331) is
    compressed unshuffled, and the device must not unshuffle it."""
    from insitubatch_nodes.io.blosc_frame import parse_blosc

    path, _ = store_factory([Var("j", (37, 333), (7, 333), dtype="int16",
                                 compressors=zc.BloscCodec(cname="zstd", shuffle="bitshuffle"))])
    frame = parse_blosc((path / "j" / "c" / "1" / "0").read_bytes(), 7 * 333 * 2)
    assert (frame.codec, frame.shuffle, frame.blocksize) == ("zstd", "bit", 7 * 333 * 2)
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    dec = HostFrameDecoder()
    loader = ib.build_loader(src, m, "train", batch_size=6, decode=dec,
                             prefetch_next_epoch=False)  # one epoch's decodes
    same(epoch(loader), epoch(ib.build_loader(src, m, "train", batch_size=6)))
    assert ran_on_device(loader) and dec.calls == [("zstd", 6)]  # all 6 chunks, one batch


def test_a_sound_blosc_frame_the_device_cannot_read_is_decoded_on_the_host(store_factory):
    """The metadata says blosc, and blosc frames name their own codec: a chunk another
    writer stored with blosclz streams is decoded on the host, not retried as damaged."""
    path, data = store_factory([Var("a", (32, 500), (8, 500), compressors=BLOSC)])
    chunk = path / "a" / "c" / "1" / "0"
    chunk.write_bytes(numcodecs.Blosc("blosclz", 5, 1).encode(data["a"][8:16]))
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    loader = ib.build_loader(src, m, "train", batch_size=6, decode=HostFrameDecoder())
    same(epoch(loader), epoch(ib.build_loader(src, m, "train", batch_size=6)))
    assert ran_on_device(loader) and loader.node(ib.AsyncFetchNode).stats.retries == 0


def test_misaligned_blosc_streams_are_decoded_on_the_host(store_factory):
    """A chunk of 7 x 999 float32 is one blosc block that LZ4 splits into four 6993-byte
    streams: they would land misaligned for nvCOMP, so such chunks are decoded on the
    host, still exactly."""
    path, _ = store_factory([Var("a", (40, 999), (7, 999), compressors=zc.BloscCodec(
        cname="lz4", shuffle="shuffle"))])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    dec = HostFrameDecoder()
    loader = ib.build_loader(src, m, "train", batch_size=6, decode=dec,
                             prefetch_next_epoch=False)  # one epoch's decodes
    same(epoch(loader), epoch(ib.build_loader(src, m, "train", batch_size=6)))
    assert set(loader.node(ib.AsyncFetchNode).window_decoder.chains) == {0}  # device path
    assert ran_on_device(loader)
    assert dec.calls == []  # ...yet nothing went to the batched decoder


def test_a_failing_device_decode_ends_the_epoch_loudly(store_factory):
    class Failing(HostFrameDecoder):
        def decode(self, *args, **kwargs):
            if len(self.calls) == 2:
                raise RuntimeError("device decode failed (test)")
            super().decode(*args, **kwargs)

    path, _ = store_factory([Var("a", (64, 5), (4, 5), compressors=zc.ZstdCodec())])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    it = iter(ib.build_loader(src, m, "train", batch_size=8, block_chunks=2,
                              decode=Failing()))
    with pytest.raises(RuntimeError, match="test") as err:
        for _ in range(20):
            next(it)
    assert any("decoding 2 stripes of the window" in n for n in err.value.__notes__)
    with pytest.raises(RuntimeError, match="test"):
        next(it)


def test_decode_option_errors(store_factory):
    path, _ = store_factory([Var("a", (16, 3), (4, 3), compressors=zc.ZstdCodec())])
    src = ib.open_source(path)
    m = ib.split_by_chunk(src, (1.0,))
    with pytest.raises(ValueError, match="decode must be 'cpu' or 'gpu', got 'nvcomp'"):
        ib.build_loader(src, m, "train", decode="nvcomp")
    with pytest.raises(TypeError, match="FrameDecoder"):
        ib.build_loader(src, m, "train", decode=42)
    with pytest.raises(ValueError, match="needs device='cuda'"):
        ib.build_loader(src, m, "train", decode="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no usable CUDA"):
            ib.build_loader(src, m, "train", decode="gpu", device="cuda")


@pytest.mark.parametrize("which", DECODERS)
def test_normalize_static_and_channels_follow_device_batches(store_factory, which):
    path, data = store_factory([Var("t", (40, 2, 3, 4), (8, 2, 3, 4),
                                    compressors=zc.ZstdCodec(),
                                    extra={"dimension_names": ("time", "level", "y", "x")}),
                                Var("u", (40, 3, 4), (8, 3, 4), compressors=zc.GzipCodec(),
                                    extra={"dimension_names": ("time", "y", "x")})])
    g = zarr.open_group(path, mode="a")
    g.create_array("level", data=np.array([500, 850]), dimension_names=("level",))
    src = ib.open_source(path, variables=["t", "u"])
    m = ib.split_by_chunk(src, (1.0,))
    stats = ib.compute_stats(src, m, "train")
    kw, dev = options(which)
    common = dict(batch_size=6, stats=stats, static={"lsm": np.ones((3, 4), np.float32)},
                  channels=[("t", 850), "u"], dtype=torch.bfloat16)
    loader = ib.build_loader(src, m, "train", **common, **kw)
    got = list(loader)
    assert ran_on_device(loader)
    assert got[0]["channels"].device == dev and got[0]["static/lsm"].device == dev
    same([{k: v.float().cpu().numpy() if v.dtype == torch.bfloat16 else v.cpu().numpy()
           for k, v in b.items()} for b in got],
         [{k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
           for k, v in b.items()} for b in ib.build_loader(src, m, "train", **common)])


@pytest.mark.skipif(not gpu_decode_available(), reason="needs CUDA and nvidia-nvcomp")
@pytest.mark.parametrize("algorithm", ["zstd", "lz4", "gzip"])
def test_nvcomp_decodes_numcodecs_frames(algorithm):
    """nvCOMP's RAW streams read what numcodecs (zarr's codecs) wrote, one batch of frames of
    mixed sizes (incl. multi-block zstd) at 16-byte offsets, on a side stream."""
    from insitubatch_nodes.io.device_decode import NvcompFrameDecoder

    codec = {"zstd": numcodecs.Zstd(level=3), "lz4": numcodecs.LZ4(),
             "gzip": numcodecs.GZip(level=5)}[algorithm]
    skip = 4 if algorithm == "lz4" else 0
    rng = np.random.default_rng(0)
    raws = [np.cumsum(rng.standard_normal(n)).astype(np.float32).tobytes()
            for n in (1, 1000, 65_536, 300_000)]
    frames = [codec.encode(r)[skip:] for r in raws]
    align = lambda n: -(-n // 16) * 16  # noqa: E731
    src_off, dst_off, s, d = [], [], 0, 0
    for f, r in zip(frames, raws, strict=True):
        src_off.append(s)
        dst_off.append(d)
        s, d = align(s + len(f)), align(d + len(r))
    host = np.zeros(s, np.uint8)
    for f, o in zip(frames, src_off, strict=True):
        host[o : o + len(f)] = np.frombuffer(f, np.uint8)
    dec = NvcompFrameDecoder("cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        src = torch.from_numpy(host).to("cuda", non_blocking=False)
        dst = torch.zeros(d, dtype=torch.uint8, device="cuda")
        dec.decode(algorithm, src, src_off, [len(f) for f in frames], dst, dst_off,
                   [len(r) for r in raws], stream)
    stream.synchronize()
    out = dst.cpu().numpy()
    for r, o in zip(raws, dst_off, strict=True):
        assert out[o : o + len(r)].tobytes() == r
