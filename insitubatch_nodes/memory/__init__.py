"""Where decoded bytes live and how much of them: the ledger and buffer pool, the resident
bound and budget, the batch layout and the in-place arena, the pinned ring, the staging seam.

Plain data and arithmetic beside ``sampling``: no IO, no torchdata.
"""
