"""What this package relies on in torchdata (0.11 here), pinned: an upgrade that changes any
of it fails here first, naming what to look at (DESIGN.md "torchdata: what is relied on").

The package reads and writes no private attribute of torchdata: ``InSituLoader`` serves
``Loader``'s protocol itself with its own iterator, on ``BaseNode``'s public protocol. What
it relies on is public behaviour, each pinned below; the one private attribute a test
reaches (a ``Prefetcher``'s thread, in ``tests/test_structure.py``) is pinned too.
"""

import inspect

import pytest
import torchdata
from torchdata.nodes import BaseNode, Loader, PinMemory, Prefetcher
from torchdata.nodes.loader import LoaderIterator

import insitubatch_nodes as ib


class _Count(BaseNode[int]):
    """0, 1, ..., n-1; its state is the next value. Counts its resets."""

    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.n, self.i, self.resets = n, 0, []

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.resets.append(initial_state)
        self.i = 0 if initial_state is None else initial_state["i"]

    def next(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def get_state(self):
        return {"i": self.i}


def test_the_pinned_version():
    """The version these pins were read from. A new one: read its base_node.py and
    loader.py, check each pin below still says what the package relies on, then move
    this line."""
    assert torchdata.__version__.split("+")[0] == "0.11.0"


def test_a_node_never_reset_is_reset_with_none_by_its_first_next_or_state_dict():
    """InSituLoader.state_dict() on a fresh loader calls its iterator's public
    state_dict(), relying on BaseNode to reset the graph to its start first; the first
    next() of a node nobody reset likewise."""
    node = _Count()
    assert node.state_dict() == {"i": 0} and node.resets == [None]
    node.reset({"i": 3})
    assert node.state_dict() == {"i": 3} and len(node.resets) == 2  # no second auto-reset
    fresh = _Count()
    assert next(fresh) == 0 and fresh.resets == [None]


def test_a_node_whose_reset_skips_super_is_refused():
    """Our nodes call super().reset(): BaseNode's own check of that is what tells a stage
    written without it (tests/test_structure.py's foreign nodes do call it)."""

    class NoSuper(_Count):
        def reset(self, initial_state=None):
            self.i = 0

    with pytest.raises(NotImplementedError, match="super"):
        next(NoSuper())


def test_the_loader_state_keys():
    """The state format (state/checkpoint.py) nests the graph's state under
    LoaderIterator.ROOT_KEY and the count under NUM_YIELDED_KEY: saved states hold these
    names, so a rename would orphan every checkpoint."""
    assert LoaderIterator.ROOT_KEY == "root"
    assert LoaderIterator.NUM_YIELDED_KEY == "num_yielded"


def test_the_loader_protocol_insituloader_serves_itself():
    """InSituLoader overrides every public method of Loader (__iter__, state_dict,
    load_state_dict) and keeps only __init__'s two public attributes; a method torchdata
    adds would run on its own (unused) private fields: look at it, and override it."""
    public = {n for n, v in vars(Loader).items() if callable(v) and not n.startswith("_")}
    assert public == {"state_dict", "load_state_dict"}
    for name in (*public, "__iter__"):
        assert name in vars(ib.InSituLoader), name
    params = list(inspect.signature(Loader.__init__).parameters)
    assert params == ["self", "root", "restart_on_stop_iteration"]
    node = _Count()
    plain = Loader(node, restart_on_stop_iteration=False)
    assert plain.root is node and plain.restart_on_stop_iteration is False


def test_foreign_nodes_keep_their_upstream_in_source():
    """InSituLoader.nodes() walks the graph by each stage's ``source`` attribute, through
    torchdata's own nodes too (a Prefetcher between our stages; PinMemory alike, which
    needs CUDA to be built)."""
    node = _Count()
    assert Prefetcher(node, prefetch_factor=2).source is node
    assert "self.source = source" in inspect.getsource(PinMemory.__init__)


def test_a_prefetcher_has_no_shutdown_and_its_thread_is_its_private_it():
    """torchdata 0.11's Prefetcher has no shutdown() (so InSituLoader.shutdown() calls every
    node's own, through it); tests/test_structure.py emulates the main branch's by stopping
    its thread through the private ``_it._shutdown()``: the one private attribute reached,
    by a test only."""
    assert not hasattr(Prefetcher, "shutdown") and not hasattr(BaseNode, "shutdown")
    p = Prefetcher(_Count(), prefetch_factor=2)
    assert next(p) == 0
    assert callable(p._it._shutdown)
    p._it._shutdown()


def test_torchdata_0_11_iterator_defects_the_loader_works_around():
    """Why InSituLoader serves Loader's protocol itself: torchdata's own iterator counts
    the item it looks ahead to after a restore twice (issue 1453), and a state loaded after
    state_dict() on a fresh Loader is ignored (PR 1548). When these fail, torchdata fixed
    them: the package's own iterator can then be reconsidered, not removed blindly."""
    loader = Loader(_Count(5))
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    again = Loader(_Count(5))
    again.load_state_dict(state)
    it2 = iter(again)
    next(it2)
    assert again.state_dict()["num_yielded"] == 4  # 3 delivered: counted twice
    fresh = Loader(_Count(5))
    fresh.state_dict()
    fresh.load_state_dict(state)
    assert next(iter(fresh)) == 0  # the loaded state (2 delivered) was ignored
