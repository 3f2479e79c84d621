"""Runtime counters (``counters``: what every layer bumps, cheap enough to stay on), their
snapshot (``loader_stats.LoaderStats``) and reading it off a graph (``collect``).

Not to be confused with ``store.statistics``: the normalization statistics of the data.
"""
