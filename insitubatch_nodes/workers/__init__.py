"""Decode worker processes: the fetch's reads and decodes run in long-lived child processes
that write straight into batch memory shared with the training process.

``shared_memory`` (the batch memory: anonymous segments mapped by every process),
``jobs`` (a window cut into compact read jobs: chunk, destination slots), ``child`` (the
worker's main loop), ``engine`` (the training process's side: start, dispatch, collect,
faults, shutdown). DESIGN.md "Worker processes" says why processes.
"""
