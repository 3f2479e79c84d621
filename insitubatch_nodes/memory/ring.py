"""HostRing: the bookkeeping of a ring of reusable host staging buffers (pure, no torch.cuda).

``PinOrCudaNode`` stages each batch in pinned host memory before its asynchronous copy to the
GPU. Pinning is slow (``cudaHostAlloc`` costs far more than the copy), so the buffers are
allocated once and reused, round-robin, in a ring of ``size`` slots. A slot holds one batch:
one flat byte buffer per batch key. The copy out of a slot runs asynchronously, so a slot may
be written again only once the event recorded after its last copy has completed; ``acquire``
checks that (``event.query()``) and waits (``event.synchronize()``) only if it must.

This module only decides *which* slot, *which* buffers and *when to wait*; the caller
supplies the allocator and the events, so it runs (and is tested) on CPU with fake events.
An event is anything with ``query() -> bool`` and ``synchronize()``, as ``torch.cuda.Event``.

Buffers are untyped bytes with a capacity: a batch whose key needs fewer bytes than the slot's
buffer holds (the short last batch of an epoch, a dtype of smaller itemsize) uses a prefix of
it; one that needs more gets a new buffer (the old one is dropped, after the slot's event has
completed). The caller makes the typed view of ``nbytes`` bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ..errors import ConfigError, InternalError

B = TypeVar("B")


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class Lease(Generic[B]):
    """One batch's hold on a slot, from ``acquire`` until ``record`` (or ``cancel``)."""

    slot: int
    generation: int
    buffers: dict[str, B]  # key -> buffer of at least nbytes[key] bytes
    nbytes: dict[str, int]
    waited: bool  # the slot's previous copy was still running: acquire waited for it
    allocated: tuple[str, ...]  # keys whose buffer was (re)allocated for this lease


@dataclass
class _Slot(Generic[B]):
    buffers: dict[str, B] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    event: Event | None = None  # recorded after the slot's last copy was issued
    leased: bool = False
    generation: int = 0


class HostRing(Generic[B]):
    """A ring of ``size`` slots of reusable host buffers; slots are handed out round-robin.

    ``allocate(nbytes)`` makes a buffer of at least ``nbytes`` bytes. Round-robin is the right
    order because copies are issued on one stream and so complete in issue order: the slot
    used longest ago is the one most likely free.
    """

    def __init__(self, size: int, allocate: Callable[[int], B]) -> None:
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"ring size must be an integer >= 1, got {size!r}")
        self.size = size
        self._allocate = allocate
        self._slots: list[_Slot[B]] = [_Slot() for _ in range(size)]
        self._next = 0
        # counters, for tests and benchmarks
        self.acquired = 0
        self.waits = 0  # acquires that had to wait for a copy still in flight
        self.allocations = 0  # buffers allocated (first use of a slot, or growth)
        self.bytes_allocated = 0

    def busy(self, slot: int) -> bool:
        """True while the copy last issued out of ``slot`` may still be reading it."""
        s = self._slots[slot]
        if s.event is None:
            return False
        if s.event.query():
            s.event = None  # completed: forget it, never query it again
            return False
        return True

    def leased(self, slot: int) -> bool:
        return self._slots[slot].leased

    def capacity(self, slot: int) -> dict[str, int]:
        return dict(self._slots[slot].capacity)

    def buffers(self, slot: int) -> dict[str, B]:
        return dict(self._slots[slot].buffers)

    def acquire(self, nbytes: Mapping[str, int], keep_others: bool = False) -> Lease[B]:
        """Take the next slot for a batch needing ``nbytes[key]`` bytes per key.

        Waits for the slot's previous copy if it is still in flight; reuses each key's
        buffer when it is large enough, else allocates one. Keys the batch does not have are
        dropped from the slot, unless ``keep_others`` (a batch whose keys are not known yet
        and are added one by one with ``grow``).
        """
        idx = self._next
        slot = self._slots[idx]
        if slot.leased:
            raise InternalError(
                f"ring slot {idx} is still leased: a batch was acquired but never recorded or "
                f"cancelled, and the ring ({self.size} slots) wrapped around to it"
            )
        waited = self.busy(idx)
        if waited:
            assert slot.event is not None
            slot.event.synchronize()
            slot.event = None
            self.waits += 1
        allocated = []
        if not keep_others:
            for key in [k for k in slot.buffers if k not in nbytes]:
                del slot.buffers[key], slot.capacity[key]
        for key, n in nbytes.items():
            if self._ensure(slot, key, n):
                allocated.append(key)
        slot.leased = True
        slot.generation += 1
        self._next = (idx + 1) % self.size
        self.acquired += 1
        return Lease(slot=idx, generation=slot.generation, buffers=dict(slot.buffers),
                     nbytes={k: int(v) for k, v in nbytes.items()}, waited=waited,
                     allocated=tuple(allocated))

    def grow(self, lease: Lease[B], key: str, nbytes: int) -> B:
        """The leased slot's buffer for ``key``, (re)allocated if smaller than ``nbytes``."""
        slot = self._check(lease)
        if self._ensure(slot, key, nbytes):
            lease.allocated = (*lease.allocated, key)
        lease.buffers[key] = slot.buffers[key]
        lease.nbytes[key] = int(nbytes)
        return slot.buffers[key]

    def _ensure(self, slot: _Slot[B], key: str, n: int) -> bool:
        n = int(n)
        if n < 0:
            raise ConfigError(f"negative size {n} for key {key!r}")
        if key in slot.buffers and slot.capacity[key] >= n:
            return False
        slot.buffers.pop(key, None)  # drop the old buffer before making the new one
        slot.buffers[key] = self._allocate(n)
        slot.capacity[key] = n
        self.allocations += 1
        self.bytes_allocated += n
        return True

    def record(self, lease: Lease[B], event: Event | None) -> None:
        """The copies out of the lease's buffers are issued; ``event`` completes after them.

        ``None`` means nothing reads the buffers any more (e.g. the copies were synchronous).
        """
        slot = self._check(lease)
        slot.event = event
        slot.leased = False

    def cancel(self, lease: Lease[B]) -> None:
        """Give the slot back with nothing in flight (the batch was never copied)."""
        slot = self._check(lease)
        slot.leased = False

    def synchronize(self) -> None:
        """Wait for every copy in flight."""
        for slot in self._slots:
            if slot.event is not None:
                slot.event.synchronize()
                slot.event = None

    def _check(self, lease: Lease[B]) -> _Slot[B]:
        slot = self._slots[lease.slot]
        if not slot.leased or slot.generation != lease.generation:
            raise InternalError(f"stale lease of ring slot {lease.slot}: it was already "
                               "recorded or cancelled")
        return slot
