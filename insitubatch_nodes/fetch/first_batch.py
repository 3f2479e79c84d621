"""How far into its first windows an epoch's (or a restore's) first batch draws, and when
it went out.

At the start the fetch submits only the windows that the first batch draws from: windows
ahead of them would share the cores with their last stripes and delay it; it tops up to its
usual depth once all of them are out. Only the shuffle buffer knows how many draws that is (its
batch size, and after a restore the head window's draws delivered before), so the graph
builder hands one ``FirstBatch`` to both, and neither looks for the other.

Decoding in place, a window is handed on before it is decoded, and planning the windows
ahead then (on the training thread, a few ms) held up the first batch though it was ready:
the fetch asks (``after_first``) to be called back once the first batch went out, which the
shuffle buffer says (``went_out``) when the next batch is asked for.
"""

from __future__ import annotations

from collections.abc import Callable


class FirstBatch:
    """``draws``: how many draws of the first windows fetched the first batch reaches (set by
    the shuffle buffer at each reset; 0 until then, and the fetch takes one window)."""

    def __init__(self) -> None:
        self.draws = 0
        self._then: Callable[[], None] | None = None

    def after_first(self, then: Callable[[], None]) -> bool:
        """Call ``then`` once the first batch went out; ``False`` (and never called) when
        no shuffle buffer says so (``draws`` still 0: a hand-built chain without one)."""
        if self.draws <= 0:
            return False
        self._then = then
        return True

    def went_out(self) -> None:
        """The first batch since the last reset went out (the shuffle buffer, when asked
        for the next one): run what waited for it."""
        then, self._then = self._then, None
        if then is not None:
            then()
