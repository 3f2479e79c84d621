"""PinOrCudaNode and its pinned ring: CPU pass-through, ring bookkeeping, staging logic.

On CPU the staging logic (``CudaStager``) runs with a fake ``CudaOps`` whose "device" copies
are deferred until their event is waited on, like a real asynchronous copy: a host slot
reused too early shows up as corrupted batches. The tests at the bottom need CUDA.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stores import BLOSC, Var, write_store
from torchdata.nodes import BaseNode

import insitubatch_nodes as ib
from insitubatch_nodes.memory.ring import HostRing
from insitubatch_nodes.nodes import pin_or_cuda
from insitubatch_nodes.nodes.pin_or_cuda import CudaStager, PinOrCudaNode, staging_view
from insitubatch_nodes.nodes.transform import TransformNode

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- fakes --------------------------------------------------------------------------------

class ListNode(BaseNode):
    """Yields the given items; state is the position (fresh dict each call)."""

    def __init__(self, items):
        super().__init__()
        self.items = list(items)
        self.resets = []

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.resets.append(initial_state)
        self.pos = initial_state["pos"] if initial_state is not None else 0

    def next(self):
        if self.pos >= len(self.items):
            raise StopIteration
        self.pos += 1
        return self.items[self.pos - 1]

    def get_state(self):
        return {"pos": self.pos}


class FakeEvent:
    """Completes when the GPU (or a synchronize) gets past the point it was recorded at."""

    def __init__(self, done=False):
        self.stream = None
        self.at = 0
        self._done = done
        self.synchronized = 0

    def record(self, stream=None):
        self.stream, self.at = stream, stream.issued if stream is not None else 0

    @property
    def done(self):
        return self._done or (self.stream is not None and self.stream.ran >= self.at)

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized += 1
        if self.stream is not None:
            self.stream.run(self.at)
        self._done = True


class LyingEvent(FakeEvent):
    """Says it completed although the copy has not run: a ring trusting it reuses too early."""

    def query(self):
        return True


class FakeStream:
    """A queue of deferred work; ``eager`` runs it as it is issued (an idle, fast GPU)."""

    def __init__(self, eager=False):
        self.eager = eager
        self.work = []
        self.issued = 0  # work items issued
        self.ran = 0  # work items run
        self.waited_on = []

    def issue(self, fn):
        self.work.append(fn)
        self.issued += 1
        if self.eager:
            self.run(self.issued)

    def run(self, upto=None):
        upto = self.issued if upto is None else upto
        while self.ran < upto:
            self.work[self.ran]()
            self.ran += 1

    def wait_event(self, event):
        self.waited_on.append(event)

    def synchronize(self):
        self.run()


class FakeOps:
    """``CudaOps`` on CPU: "pinned" buffers are plain tensors, device copies are deferred."""

    device = torch.device("cuda", 0)  # what PinOrCudaNode(ops=...) takes as its device

    def __init__(self, eager=False, event_cls=FakeEvent):
        self.eager = eager
        self.event_cls = event_cls
        self.consumer = FakeStream(eager=True)
        self.streams = []
        self.current = None
        self.events = []
        self.handed = []  # (tensor, stream)
        self.pinned_allocs = []

    def new_stream(self):
        s = FakeStream(eager=self.eager)
        self.streams.append(s)
        return s

    def current_stream(self):
        return self.consumer

    @contextlib.contextmanager
    def use_stream(self, stream):
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def new_event(self):
        e = self.event_cls()
        self.events.append(e)
        return e

    def pinned(self, nbytes):
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned_allocs.append(buf)
        return buf

    def register_host(self, address, nbytes):
        """Page-lock memory mapped elsewhere (the decode workers' shared batches): here, a
        buffer that counts as pinned from now on."""
        import ctypes

        view = (ctypes.c_uint8 * nbytes).from_address(address)
        self.pinned_allocs.append(torch.from_numpy(np.ctypeslib.as_array(view)))

    def is_pinned(self, tensor):
        """Inside a buffer ``pinned`` or ``register_host`` made (what cudaHostAlloc'd or
        registered memory is to CUDA)."""
        p = tensor.data_ptr()
        return any(b.data_ptr() <= p < b.data_ptr() + b.numel() for b in self.pinned_allocs)

    def to_device(self, host):
        assert self.current is not None, "device copies must be issued on the side stream"
        assert host.is_contiguous() and self.is_pinned(host), "async copies read pinned memory"
        # Like a DMA, the deferred copy reads the memory, not the tensor: it must not keep
        # the host tensor (and the pool buffer behind it) alive until it runs.
        base = next(b for b in self.pinned_allocs
                    if b.data_ptr() <= host.data_ptr() < b.data_ptr() + b.numel())
        at, n = host.data_ptr() - base.data_ptr(), host.numel() * host.element_size()
        raw = base[at:at + n].view(host.dtype).view(host.shape)
        out = torch.full(host.shape, 0, dtype=host.dtype)
        self.current.issue(lambda: out.copy_(raw))
        return out

    def hand_over(self, tensor, stream):
        self.handed.append((tensor, stream))


def batch(n, seed, dtype=torch.float32, extra=4):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand((n, extra), generator=g) * 1000).to(dtype)
    return {"x": x, "y": torch.arange(n, dtype=torch.int16) + seed,
            "sample_index": torch.arange(seed * 100, seed * 100 + n, dtype=torch.int64)}


def clone(b):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k].cpu(), b[k].cpu()), k
        else:
            assert a[k] == b[k]


# -- CPU path: pass-through, no CUDA API ---------------------------------------------------

@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_path_is_a_zero_copy_pass_through(device):
    items = [batch(5, s) for s in range(3)]
    originals = [dict(item) for item in items]  # the tensors, before the node sees them
    node = PinOrCudaNode(ListNode(items), device=device)
    node.reset(None)
    for item, orig in zip(items, originals, strict=True):
        got = next(node)
        assert got is item  # the same dict ...
        for k, t in orig.items():  # ... still holding the very same tensors: no copy
            assert got[k] is t and got[k].data_ptr() == t.data_ptr()
    with pytest.raises(StopIteration):
        next(node)
    assert node.ring is None


CUDA_ONLY = ["is_available", "current_device", "device_count", "Stream", "Event",
             "current_stream", "stream", "synchronize", "set_device"]


@pytest.fixture
def no_cuda_api(monkeypatch):
    """Every CUDA entry point the node could reach raises if it is called."""
    calls = []

    def forbid(name):
        def boom(*a, **k):
            calls.append(name)
            raise AssertionError(f"CUDA API {name} called on the CPU path")
        return boom

    for name in CUDA_ONLY:
        monkeypatch.setattr(torch.cuda, name, forbid(f"torch.cuda.{name}"))
    for name in ("pin_memory", "record_stream", "cuda"):
        monkeypatch.setattr(torch.Tensor, name, forbid(f"Tensor.{name}"))
    monkeypatch.setattr(pin_or_cuda, "CudaOps", forbid("CudaOps"))
    monkeypatch.setattr(pin_or_cuda, "CudaStager", forbid("CudaStager"))
    return calls


@pytest.mark.parametrize("device", [None, "cpu"])
def test_cpu_path_never_calls_cuda(no_cuda_api, device):
    items = [batch(5, s) for s in range(4)]
    node = PinOrCudaNode(ListNode(items), device=device)
    node.reset(None)
    assert all(next(node) is item for item in items)
    node.synchronize()
    assert no_cuda_api == []


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("pin") / "s.zarr"
    data = write_store(path, [Var("x", (61, 3), (8, 3), compressors=BLOSC),
                              Var("h", (61, 2), (5, 2), dtype="float16"),
                              Var("y", (61,), (4,), dtype="int16")])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,)), data


def epoch(loader):
    return [{k: v.cpu().numpy().copy() for k, v in b.items()} for b in loader]


def test_loader_cpu_path_never_calls_cuda(store, no_cuda_api):
    src, m, data = store
    with ib.build_loader(src, m, "train", batch_size=7, block_chunks=2, device=None,
                         rank=0, world_size=1) as loader:
        batches = epoch(loader)
    assert sorted(np.concatenate([b["sample_index"] for b in batches]).tolist()) == \
        list(range(61))
    assert no_cuda_api == []


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(RuntimeError, match="no usable CUDA.*device=None or 'cpu'"):
            PinOrCudaNode(ListNode([]), device=device)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3"])
def test_ring_size_is_checked(bad):
    with pytest.raises(ValueError, match="ring_size"):
        PinOrCudaNode(ListNode([]), device=None, ring_size=bad)


def test_state_is_fresh_and_reset_cascades():
    src = ListNode([batch(2, s) for s in range(5)])
    node = PinOrCudaNode(src, device=None, ring_size=2)
    node.reset(None)
    next(node), next(node)
    s1, s2 = node.get_state(), node.get_state()
    assert s1 == s2 == {"source": {"pos": 2}} and s1 is not s2
    assert s1["source"] is not s2["source"]
    json.dumps(s1)
    node.reset(s1)
    assert src.resets[-1] == {"pos": 2}
    assert next(node) is src.items[2]
    node.reset(None)
    assert src.resets[-1] is None and next(node) is src.items[0]


# -- HostRing: pure bookkeeping with fake events --------------------------------------------

def make_ring(size):
    allocs = []

    def allocate(n):
        buf = bytearray(n)
        allocs.append(buf)
        return buf

    return HostRing(size, allocate), allocs


def test_ring_round_robin_and_wrap_around():
    ring, allocs = make_ring(3)
    slots = []
    for _ in range(7):
        lease = ring.acquire({"x": 16, "y": 4})
        slots.append(lease.slot)
        ring.record(lease, FakeEvent(done=True))
    assert slots == [0, 1, 2, 0, 1, 2, 0]
    assert ring.allocations == 6 and len(allocs) == 6  # 3 slots x 2 keys, then reused
    assert ring.waits == 0 and ring.acquired == 7


def test_ring_buffers_are_reused_per_slot():
    ring, _ = make_ring(2)
    first = []
    for i in range(6):
        lease = ring.acquire({"x": 32})
        if i < 2:
            first.append(lease.buffers["x"])
        else:
            assert lease.buffers["x"] is first[lease.slot]
            assert lease.allocated == ()
        ring.record(lease, None)


def test_ring_reuses_a_slot_only_after_its_copy_completed():
    ring, _ = make_ring(2)
    events = []
    for _ in range(2):
        lease = ring.acquire({"x": 8})
        events.append(FakeEvent())
        ring.record(lease, events[-1])
    assert ring.busy(0) and ring.busy(1)
    events[1]._done = True  # slot 1 finished first: no matter, slot 0 comes next
    assert not ring.busy(1)
    lease = ring.acquire({"x": 8})
    assert lease.slot == 0 and lease.waited and events[0].synchronized == 1
    assert ring.waits == 1
    ring.record(lease, FakeEvent(done=True))
    lease = ring.acquire({"x": 8})  # slot 1: completed, so no wait
    assert lease.slot == 1 and not lease.waited and events[1].synchronized == 0
    assert ring.waits == 1


def test_ring_completed_event_is_not_waited_on():
    ring, _ = make_ring(1)
    ev = FakeEvent(done=True)
    lease = ring.acquire({"x": 8})
    ring.record(lease, ev)
    lease = ring.acquire({"x": 8})
    assert not lease.waited and ev.synchronized == 0


def test_ring_short_last_batch_uses_a_prefix_and_growth_reallocates():
    ring, allocs = make_ring(1)
    full = ring.acquire({"x": 400, "idx": 80})
    ring.record(full, None)
    short = ring.acquire({"x": 120, "idx": 24})  # short last batch: prefix of the same buffer
    assert short.buffers["x"] is full.buffers["x"] and short.allocated == ()
    assert short.nbytes == {"x": 120, "idx": 24}
    assert ring.capacity(0) == {"x": 400, "idx": 80}
    ring.record(short, None)
    big = ring.acquire({"x": 800, "idx": 80})  # a bigger batch: grow "x" only
    assert big.allocated == ("x",) and big.buffers["x"] is not full.buffers["x"]
    assert big.buffers["idx"] is full.buffers["idx"]
    assert ring.capacity(0) == {"x": 800, "idx": 80} and len(allocs) == 3
    assert ring.bytes_allocated == 400 + 80 + 800


def test_ring_dtype_change_reinterprets_bytes_and_keys_follow_the_batch():
    ring, _ = make_ring(1)
    a = ring.acquire({"x": 4 * 10})  # float32 x 10
    ring.record(a, None)
    b = ring.acquire({"x": 2 * 10, "new": 3})  # float16 x 10: same buffer, fewer bytes
    assert b.buffers["x"] is a.buffers["x"] and b.allocated == ("new",)
    ring.record(b, None)
    c = ring.acquire({"new": 3})
    assert set(c.buffers) == {"new"} and ring.capacity(0) == {"new": 3}
    ring.record(c, None)


def test_ring_lease_misuse_is_an_error():
    ring, _ = make_ring(2)
    a = ring.acquire({"x": 1})
    b = ring.acquire({"x": 1})
    with pytest.raises(RuntimeError, match="still leased"):
        ring.acquire({"x": 1})  # wrapped onto slot 0, never recorded
    ring.record(a, None)
    with pytest.raises(RuntimeError, match="stale lease"):
        ring.record(a, None)
    ring.cancel(b)
    assert not ring.leased(1) and not ring.busy(1)
    with pytest.raises(RuntimeError, match="stale lease"):
        ring.cancel(b)
    with pytest.raises(ValueError, match="negative"):
        ring.acquire({"x": -1})
    with pytest.raises(ValueError, match="ring size"):
        HostRing(0, bytearray)


def test_ring_synchronize_waits_for_everything():
    ring, _ = make_ring(3)
    events = [FakeEvent() for _ in range(3)]
    for ev in events:
        ring.record(ring.acquire({"x": 1}), ev)
    ring.synchronize()
    assert all(ev.synchronized == 1 for ev in events)
    assert not any(ring.busy(i) for i in range(3))


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 5),
       steps=st.lists(st.tuples(st.integers(0, 64), st.integers(0, 3)), min_size=1,
                      max_size=40))
def test_ring_never_hands_out_a_slot_with_a_copy_in_flight(size, steps):
    """A simulated GPU finishes copies in issue order, ``progress`` of them between batches;
    whatever the timing, a slot is handed out only once its last copy has completed."""
    ring, _ = make_ring(size)
    issued = []  # events in issue order
    last = {}  # slot -> its last event
    completed = 0
    for nbytes, progress in steps:
        completed = min(len(issued), completed + progress)
        for ev in issued[:completed]:
            ev._done = True
        lease = ring.acquire({"x": nbytes})
        prev = last.get(lease.slot)
        assert prev is None or prev.done  # completed, or acquire waited for it
        assert lease.waited == (prev is not None and prev.synchronized > 0)
        assert len(lease.buffers["x"]) >= nbytes
        ev = FakeEvent()
        issued.append(ev)
        last[lease.slot] = ev
        ring.record(lease, ev)
    assert ring.acquired == len(steps)


# -- GatherNode writes into the ring slot (CPU, fake ops) ---------------------------------

def fake_cuda_graph(src, m, ops, ring_size, steps=None, normalize_dtype=None,
                    in_place=False, workers=0):
    """The standard graph (graph.py) with the CUDA calls of PinOrCudaNode replaced by ``ops``:
    the window-and-gather path unless ``in_place`` (None: as ``build_loader`` decides)."""
    from insitubatch_nodes.graph import build_graph, resolve

    stats = ib.compute_stats(src, m, "train") if normalize_dtype is not None else None
    cfg = ib.LoaderConfig.of(seed=4, rank=0, world_size=1, block_chunks=2, max_inflight=4,
                             batch_size=6, steps=steps, ring_size=ring_size, stats=stats,
                             dtype=normalize_dtype, in_place=in_place, workers=workers)
    return build_graph(src, m, "train", resolve(src, m, "train", cfg), ops=ops).root


def run_graph(node, epochs=2):
    out = []
    for _ in range(epochs):
        node.reset(None)
        while True:
            try:
                out.append(next(node))
            except StopIteration:
                break
    node.synchronize()
    return [{k: (v.float() if v.dtype == torch.bfloat16 else v).numpy().copy()
             for k, v in b.items()} for b in out]


@pytest.mark.parametrize("in_place", [False, None], ids=["gathered", "scattered"])
@pytest.mark.parametrize("case", ["plain", "windows", "cast"])
def test_gather_writes_into_the_pinned_slot_and_batches_stay_exact(store, case, in_place):
    """With copies deferred on a slow fake GPU and only 2 slots, batches gathered straight
    into the ring (or chunks of several samples scattered into pinned batches, in place)
    equal the CPU gather path's, and the variables are never memcpy'd on the host."""
    src, m, data = store
    window = ib.SampleWindow(2, (1,)) if case == "windows" else None
    cast = torch.bfloat16 if case == "cast" else None
    ops = FakeOps(eager=False)
    node = fake_cuda_graph(src, m, ops, 2, window, cast, in_place=in_place)
    assert (ib.InSituLoader(node).node(ib.AsyncFetchNode).arena is None) == (in_place is False)
    got = run_graph(node)
    want = run_graph(_cpu_graph(src, m, window, cast))
    assert len(got) == len(want) > 10
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in g:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)
        if case == "plain":  # and both are the stored rows
            for name, arr in data.items():
                np.testing.assert_array_equal(g[name], arr[g["sample_index"]])
    stager = node._stager
    n_rows = sum(len(b["sample_index"]) for b in got)
    assert stager.ring.waits > 0  # the slow GPU made the ring wrap onto copies in flight
    if case == "cast":  # normalizing and casting made new tensors: those are copied
        assert stager.bytes_in_place == 0
    else:
        assert stager.bytes_copied == n_rows * 8  # sample_index (int64) only
        assert stager.bytes_in_place == sum(
            v.numel() * v.element_size() for b in got for k, v in
            ((k, torch.from_numpy(a)) for k, a in b.items()) if k != "sample_index")


def _cpu_graph(src, m, window, cast):
    node = fake_cuda_graph(src, m, FakeOps(eager=True), 1, window, cast)
    node._ops = None
    node.device = None  # the plain CPU pass-through over the same graph
    return node


def test_gather_into_slot_fails_loudly_if_the_ring_lied(store):
    """Control: with events that claim completion too early, a slot is rewritten while its
    copy waits, so the batches differ (the test above would catch a real early reuse)."""
    src, m, _ = store
    got = run_graph(fake_cuda_graph(src, m, FakeOps(eager=False, event_cls=LyingEvent), 2))
    want = run_graph(_cpu_graph(src, m, None, None))
    assert any(not np.array_equal(g["x"], w["x"]) for g, w in zip(got, want, strict=True))


def test_gather_into_slot_only_through_stages_that_keep_the_batch(store):
    """A cast makes new tensors: the gather must not fill pinned buffers nobody copies. A
    stage that only adds keys (static fields) keeps the in-place gather."""
    from insitubatch_nodes.graph_stages import staging_through
    from insitubatch_nodes.nodes.static import StaticFieldsNode

    src, m, _ = store
    cast = fake_cuda_graph(src, m, FakeOps(eager=True), 2, normalize_dtype=torch.bfloat16)
    run_graph(cast, epochs=1)
    assert cast.staging is None and cast._stager.bytes_in_place == 0
    plain = fake_cuda_graph(src, m, FakeOps(eager=True), 2)
    gather = plain.source
    fields = StaticFieldsNode(gather, {"lsm": np.ones((3,), np.float32)})
    static = PinOrCudaNode(fields, ops=FakeOps(eager=True), ring_size=2,
                           staging=staging_through(gather, [fields]))
    got = run_graph(static, epochs=1)
    assert static.staging is gather.staging is not None
    assert static._stager.bytes_in_place > 0
    assert all(np.array_equal(b["static/lsm"], np.ones((len(b["x"]), 3))) for b in got)


class _TransposeX(TransformNode):
    """A stage that claims to keep the batch's memory but hands on a view of it in another
    layout: the stager must not copy the slot onto itself."""

    keeps_batch_memory = True

    def next(self):
        batch = next(self.source)
        batch["x"] = batch["x"].t()
        return batch


def test_a_view_of_the_slot_in_another_layout_is_copied_safely(store):
    src, m, _ = store
    from insitubatch_nodes.graph_stages import staging_through

    gpu = fake_cuda_graph(src, m, FakeOps(eager=False), 2)
    transposed = _TransposeX(gpu.source)
    gpu = PinOrCudaNode(transposed, ops=gpu._ops, ring_size=2,
                        staging=staging_through(gpu.source, [transposed]))
    cpu = _cpu_graph(src, m, None, None)
    cpu = PinOrCudaNode(_TransposeX(cpu.source), device=None)
    got, want = run_graph(gpu), run_graph(cpu)
    assert gpu.staging is not None and gpu._stager.bytes_in_place > 0  # h, y still in place
    assert len(got) == len(want) and got[0]["x"].shape[0] == 3
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g["x"], w["x"])


def test_gather_into_slot_cancels_the_slot_at_epoch_end(store):
    src, m, _ = store
    node = fake_cuda_graph(src, m, FakeOps(eager=True), 3)
    run_graph(node, epochs=3)  # each epoch ends with an opened-then-cancelled slot
    assert not any(node._stager.ring.leased(i) for i in range(3))


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """One sample per chunk: the fetch decodes each chunk straight into its batch row."""
    path = tmp_path_factory.mktemp("pin1") / "s.zarr"
    data = write_store(path, [Var("x", (53, 3, 4), (1, 3, 4), compressors=BLOSC),
                              Var("y", (53, 2), (1, 2), dtype="int16")])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,)), data


@pytest.mark.parametrize("workers", [0, 2], ids=["threads", "workers"])
@pytest.mark.parametrize("event_cls", [FakeEvent, LyingEvent])
def test_in_place_batches_go_to_the_gpu_from_the_pinned_arena(one_step, event_cls, workers):
    """One sample per chunk: chunks are decoded into pinned batch memory (by decode threads,
    or by worker processes into shared memory page-locked a segment at a time) and copied
    to the device from there (no host copy of a variable), through a slow fake GPU; the
    arena's memory is recycled only after its copy ran. Control: with events that claim
    completion too early, the arena reuses memory whose copy still waits, and the batches
    differ."""
    src, m, data = one_step
    ops = FakeOps(eager=False, event_cls=event_cls)
    # copies deferred up to 5 batches: a window
    node = fake_cuda_graph(src, m, ops, 5, in_place=None if workers else False, workers=workers)
    got = run_graph(node, epochs=3)  # in which the arena reuses memory freed too early
    want = run_graph(_cpu_graph(src, m, None, None), epochs=3)
    assert len(got) == len(want) == 3 * 9
    same = all(np.array_equal(g[k], w[k]) for g, w in zip(got, want, strict=True) for k in g)
    if event_cls is LyingEvent:
        assert not same
        return
    assert same
    for b in got:
        for name, arr in data.items():
            np.testing.assert_array_equal(b[name], arr[b["sample_index"]])
    stager = node._stager
    rows = 3 * 53
    assert stager.bytes_copied == rows * 8  # sample_index only
    assert stager.bytes_in_place == rows * (12 * 4 + 2 * 2)
    assert len(stager._held) < 5  # at most ring_size batches held, none after synchronize
    node.synchronize()
    assert not stager._held


def test_in_place_pinned_batches_resume_exactly(one_step):
    """The pinned arena and held batches change nothing of resume: a graph restored from
    the state after k batches serves the rest of the epoch as the uninterrupted one."""
    src, m, _ = one_step
    full = run_graph(fake_cuda_graph(src, m, FakeOps(eager=False), 3), epochs=1)
    for k in (1, 4, 8):
        node = fake_cuda_graph(src, m, FakeOps(eager=False), 3)
        node.reset(None)
        head = [next(node) for _ in range(k)]
        state = node.state_dict()
        node.synchronize()
        head = [{key: v.numpy().copy() for key, v in b.items()} for b in head]
        again = fake_cuda_graph(src, m, FakeOps(eager=False), 3)
        again.reset(state)
        rest = []
        while True:
            try:
                rest.append(next(again))
            except StopIteration:
                break
        again.synchronize()
        rest = [{key: v.numpy().copy() for key, v in b.items()} for b in rest]
        assert len(head) + len(rest) == len(full)
        for g, w in zip(head + rest, full, strict=True):
            for key in w:
                np.testing.assert_array_equal(g[key], w[key], err_msg=key)
        assert again._stager.bytes_in_place > 0


def test_in_place_stays_pageable_when_a_stage_makes_new_tensors(one_step):
    """A cast makes new tensors: the arena is not pinned (those would be pinned for
    nothing) and the cast batches are copied into the ring."""
    src, m, _ = one_step
    ops = FakeOps(eager=True)
    node = fake_cuda_graph(src, m, ops, 2, normalize_dtype=torch.bfloat16)
    got = run_graph(node, epochs=1)
    assert len(got) == 9 and node.staging is None
    assert node._stager.bytes_in_place == 0 and not node._stager._held
    assert sum(b.numel() for b in ops.pinned_allocs) == sum(
        b.numel() for i in range(2) for b in node._stager.ring.buffers(i).values())


# -- CudaStager on CPU with fake ops: staging, streams, events ------------------------------

def test_staging_view_shapes_and_dtypes():
    buf = torch.zeros(64, dtype=torch.uint8)
    for like in (torch.ones(3, 4), torch.ones(5, dtype=torch.float16), torch.ones(2, 3,
                 dtype=torch.int64), torch.ones(0, 6), torch.tensor(1.5),
                 torch.ones(7, dtype=torch.bool)):
        v = staging_view(buf, like.numel() * like.element_size(), like)
        assert v.shape == like.shape and v.dtype == like.dtype and v.is_contiguous()
        assert v.numel() == 0 or v.data_ptr() == buf.data_ptr()


def run_stager(ops, batches, ring_size):
    stager = CudaStager(ops, ring_size)
    outs = [stager(b) for b in batches]
    return stager, outs


def test_stager_copies_bit_for_bit_through_a_slow_gpu():
    """Nothing runs on the fake GPU until the ring must wait: every slot reuse must wait for
    the copy out of it, or later batches would overwrite data still to be copied."""
    batches = [batch(8, s) for s in range(7)] + [batch(3, 99)]  # short last batch
    ref = [clone(b) for b in batches]
    ops = FakeOps(eager=False)
    stager, outs = run_stager(ops, batches, ring_size=3)
    assert stager.ring.waits == len(batches) - 3
    stager.synchronize()
    for got, want in zip(outs, ref, strict=True):
        assert_same(got, want)
    # three slots x three keys were allocated once; the short batch used prefixes
    assert stager.ring.allocations == 9 and len(ops.pinned_allocs) == 9


def test_a_failed_copy_frees_its_slot_even_when_the_wait_fails_too():
    """A device copy that raises (out of memory) is followed by a wait for what was issued;
    if that raises as well (a sticky CUDA error), the slot must still be given back, or
    after ``ring_size`` batches the user sees "still leased" instead of the CUDA error."""
    class Failing(FakeOps):
        def to_device(self, host):
            raise RuntimeError("CUDA error: out of memory")

    class BrokenStream(FakeStream):
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    ops = Failing(eager=True)
    ops.new_stream = lambda: BrokenStream(eager=True)
    stager = CudaStager(ops, ring_size=1)
    for seed in range(3):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            stager(batch(4, seed))


def test_stager_with_a_lying_event_corrupts_so_the_fake_has_teeth():
    """Control: if the ring trusted an event that reports completion too early, the host
    slot would be overwritten before its copy ran, and the fake sees it."""
    batches = [batch(8, s) for s in range(4)]
    ref = [clone(b) for b in batches]
    ops = FakeOps(eager=False, event_cls=LyingEvent)
    stager, outs = run_stager(ops, batches, ring_size=2)
    assert stager.ring.waits == 0
    for s in ops.streams:
        s.run()
    assert not torch.equal(outs[0]["x"], ref[0]["x"])  # batch 0 got batch 2's data


def test_bench_gpu_ring_path_makes_batches_in_the_ring_slot():
    """benchmarks/bench_gpu.py times the in-slot path with a batch maker sharing a
    ``StagingSeam`` with the node; on a fake GPU, every byte is sent from the slot."""
    from benchmarks.bench_gpu import in_slot_ring

    like = batch(6, 1)
    node = in_slot_ring(like, 7, FakeOps.device, 2, ops=FakeOps(eager=False))
    node.reset(None)
    got = list(node)
    node.synchronize()
    nb = sum(v.numel() * v.element_size() for v in like.values())
    assert len(got) == 7 and node.bytes_copied == 0 and node.bytes_in_place == 7 * nb
    assert all(g[k].shape == like[k].shape and g[k].dtype == like[k].dtype
               for g in got for k in like)


def test_stager_fast_gpu_never_waits_and_reuses_pinned_memory():
    batches = [batch(8, s) for s in range(10)]
    ref = [clone(b) for b in batches]
    ops = FakeOps(eager=True)
    stager, outs = run_stager(ops, batches, ring_size=3)
    assert stager.ring.waits == 0 and stager.ring.allocations == 9
    for got, want in zip(outs, ref, strict=True):
        assert_same(got, want)


def test_stager_streams_events_and_hand_over():
    batches = [batch(6, s) for s in range(4)]
    ops = FakeOps(eager=False)
    stager, outs = run_stager(ops, batches, ring_size=2)
    assert len(ops.streams) == 1 and stager.stream is ops.streams[0]
    # one event per batch, recorded on the side stream after that batch's 3 copies
    assert [e.stream for e in ops.events] == [stager.stream] * 4
    assert [e.at for e in ops.events] == [3, 6, 9, 12]
    # the consumer stream waited on each batch's own event, in order
    assert ops.consumer.waited_on == ops.events
    # every device tensor was handed over to the consumer stream
    handed = {id(t) for t, s in ops.handed if s is ops.consumer}
    assert handed == {id(v) for o in outs for v in o.values()}


def test_stager_dtype_change_and_passthrough_values():
    b16 = batch(8, 1, dtype=torch.float16)
    b64 = batch(8, 2, dtype=torch.float64)
    b64["name"] = "not a tensor"
    batches = [batch(8, 0), b16, b64, batch(2, 3)]
    ref = [clone(b) for b in batches]
    ops = FakeOps(eager=False)
    stager, outs = run_stager(ops, batches, ring_size=1)
    stager.synchronize()
    for got, want in zip(outs, ref, strict=True):
        assert_same(got, want)
    # ring of 1: float32 -> float16 reuses the slot, float64 (twice the bytes) grows it
    assert stager.ring.waits == 3
    assert stager.ring.capacity(0)["x"] == 8 * 4 * 8


def test_stager_failure_leaves_the_slot_usable():
    class Boom(Exception):
        pass

    class FailingOps(FakeOps):
        fail = True

        def to_device(self, host):
            out = super().to_device(host)
            if self.fail:
                raise Boom
            return out

    ops = FailingOps(eager=False)
    stager = CudaStager(ops, ring_size=1)
    with pytest.raises(Boom):
        stager(batch(4, 0))
    assert not stager.ring.leased(0)
    assert stager.stream.ran == stager.stream.issued  # what was issued has finished
    ops.fail = False
    want = batch(4, 1)
    got = stager(clone(want))
    stager.synchronize()
    assert_same(got, want)


# -- GPU: run on a CUDA machine ----------------------------------------------------------------

@needs_cuda
def test_cuda_loader_batches_equal_cpu_batches_bit_for_bit(store):
    src, m, data = store
    kw = dict(batch_size=7, block_chunks=2, seed=3, rank=0, world_size=1)
    with ib.build_loader(src, m, "train", device=None, **kw) as cpu, \
            ib.build_loader(src, m, "train", device="cuda", **kw) as gpu:
        for _ in range(2):  # two epochs: the ring wraps many times
            want = epoch(cpu)
            kept = list(gpu)  # keep every device batch of the epoch, then compare
            torch.cuda.synchronize()
            assert all(v.device.type == "cuda" for b in kept for v in b.values())
            got = [{k: v.cpu().numpy() for k, v in b.items()} for b in kept]
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert g.keys() == w.keys()
                for k in g:
                    assert g[k].dtype == w[k].dtype
                    np.testing.assert_array_equal(g[k], w[k])
            for b in got:
                for name, arr in data.items():
                    np.testing.assert_array_equal(b[name], arr[b["sample_index"]])
        # the variables were gathered straight into the pinned ring, not copied there
        pin = next(n for n in gpu.nodes() if isinstance(n, PinOrCudaNode))
        rows = 2 * 61  # two epochs; x: 3 float32, h: 2 float16, y: 1 int16 per row
        assert pin._stager.bytes_in_place == rows * (3 * 4 + 2 * 2 + 2)
        assert pin._stager.bytes_copied == rows * 8  # sample_index only
        assert all(buf.is_pinned() for i in range(pin.ring.size)
                   for buf in pin.ring.buffers(i).values())


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2], ids=["threads", "workers"])
def test_cuda_in_place_batches_are_copied_from_pinned_arena_memory(one_step, workers):
    """One sample per chunk on a real GPU: chunks are decoded into pinned batch memory (by
    worker processes: shared memory page-locked with cudaHostRegister) and copied from
    there; only ``sample_index`` goes through the ring."""
    src, m, data = one_step
    kw = dict(batch_size=6, block_chunks=3, seed=5, rank=0, world_size=1)
    with ib.build_loader(src, m, "train", device=None, workers=0, **kw) as cpu, \
            ib.build_loader(src, m, "train", device="cuda", workers=workers, **kw) as gpu:
        assert gpu.node(ib.AsyncFetchNode).arena is not None
        for _ in range(3):
            want = epoch(cpu)
            kept = list(gpu)
            torch.cuda.synchronize()
            got = [{k: v.cpu().numpy() for k, v in b.items()} for b in kept]
            assert len(got) == len(want) == 9
            for g, w in zip(got, want, strict=True):
                for k in g:
                    np.testing.assert_array_equal(g[k], w[k], err_msg=k)
        pin = gpu.node(PinOrCudaNode)
        rows = 3 * 53
        assert pin._stager.bytes_copied == rows * 8
        assert pin._stager.bytes_in_place == rows * (12 * 4 + 2 * 2)


@needs_cuda
def test_cuda_host_slots_not_overwritten_while_copy_in_flight():
    """Delay every copy on the side stream with a GPU sleep: a slot reused before its
    copy ran would hand the GPU the next batch's bytes."""
    ops = pin_or_cuda.CudaOps(torch.device("cuda"))
    stager = CudaStager(ops, ring_size=2)
    batches = [batch(4096, s, extra=64) for s in range(8)]
    ref = [clone(b) for b in batches]
    outs = []
    for b in batches:
        with torch.cuda.stream(stager.stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms: the copy below runs well after next()
        outs.append(stager(b))
    assert stager.ring.waits >= len(batches) - 2
    torch.cuda.synchronize()
    for got, want in zip(outs, ref, strict=True):
        assert_same(got, want)
    # ...and the pinned buffers really are reused (2 slots x 3 keys)
    assert stager.ring.allocations == 6
    assert all(buf.is_pinned() for i in range(2) for buf in stager.ring.buffers(i).values())


@needs_cuda
def test_cuda_resume_and_exactly_once_unchanged(store):
    src, m, _ = store
    kw = dict(batch_size=5, block_chunks=2, seed=11, rank=0, world_size=1, device="cuda")
    with ib.build_loader(src, m, "train", **kw) as full:
        whole = epoch(full) + epoch(full)
    n1 = len(whole) // 2
    for stop in (1, 4, n1 - 1):
        with ib.build_loader(src, m, "train", **kw) as a:
            it = iter(a)
            head = [{k: v.cpu().numpy().copy() for k, v in next(it).items()}
                    for _ in range(stop)]
            state = json.loads(json.dumps(a.state_dict()))
        with ib.build_loader(src, m, "train", **kw) as b:
            b.load_state_dict(state)
            tail = epoch(b) + epoch(b)
        got = head + tail
        assert len(got) == len(whole)
        for g, w in zip(got, whole, strict=True):
            for k in g:
                np.testing.assert_array_equal(g[k], w[k])
    idx = np.concatenate([b["sample_index"] for b in whole[:n1]])
    assert sorted(idx.tolist()) == list(range(61))


@needs_cuda
def test_cuda_batches_are_usable_on_the_consumer_stream():
    """The consumer stream waits for the copy: a kernel queued right after next() reads the
    copied data, also on a non-default current stream."""
    items = [batch(1024, s, extra=256) for s in range(6)]
    ref = [clone(b) for b in items]
    node = PinOrCudaNode(ListNode(items), device="cuda", ring_size=2)
    node.reset(None)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        sums = [next(node)["x"].double().sum() for _ in items]
    side.synchronize()
    for s, want in zip(sums, ref, strict=True):
        assert s.item() == want["x"].double().sum().item()

