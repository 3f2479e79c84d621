"""Pure index math, no IO: the sample grid, time steps, read plans, per-epoch schedules
and rank shares, chunk permutations, shuffle quality, and the items stages pass on.

The bottom layer: everything else may import it, it imports nothing of the package but
``errors``.
"""
