"""Runtime counters (``counters``: what every layer bumps, cheap enough to stay on) and their
snapshot (``loader_stats.LoaderStats``): the bottom layer, importing no stage. Reading them
off a graph's nodes is ``graph_stats.collect_stats``.

Not to be confused with ``store.statistics``: the normalization statistics of the data.
"""
