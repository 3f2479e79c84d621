"""The parts of the fetch stage (``nodes.async_fetch.AsyncFetchNode``): how windows are
submitted (``submit.SubmitPath`` and one path per way of reading), the first-batch hold, the
next epoch started early, the loop thread and a window's work items.
"""
