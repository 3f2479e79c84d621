"""How far into its first windows an epoch's (or a restore's) first batch draws.

At the start the fetch submits only the windows that the first batch draws from: windows
ahead of them would share the cores with their last stripes and delay it; it tops up to its
usual depth once all of them are out. Only the shuffle buffer knows how many draws that is (its
batch size, and after a restore the head window's draws delivered before), so the graph
builder hands one ``FirstBatch`` to both, and neither looks for the other.
"""

from __future__ import annotations


class FirstBatch:
    """``draws``: how many draws of the first windows fetched the first batch reaches (set by
    the shuffle buffer at each reset; 0 until then, and the fetch takes one window)."""

    def __init__(self) -> None:
        self.draws = 0
