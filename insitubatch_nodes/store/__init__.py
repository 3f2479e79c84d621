"""The store as the loader sees it: opening URLs and icechunk repositories, layout
discovery (``Source``), anemoi datasets, split manifests, normalization statistics.
"""
