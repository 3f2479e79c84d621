"""Device decode: variables whose codec chain the device can decode are fetched compressed
(checked frames) on the event loop and decoded per window on the device thread
(``WindowDecoder``); the others are read as ``LoopSubmit`` reads them. Plans, order and
state do not change, so neither do resume and exactly-once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..io.device_chain import DeviceChain, HostOnly, device_chain_for
from ..io.device_decode import FrameDecoder, StripeFrames, WindowDecoder
from ..io.reader import StripeReader
from ..io.served import Reader
from ..io.served.axis import AxisStripeReader
from ..metrics.counters import FetchStats
from ..sampling.items import DecodedWindow
from ..sampling.plan import ReadPlan
from .hold import FirstBatchHold
from .loop import FetchLoop
from .loop_submit import LoopSubmit, gather_or_cancel
from .submit import FetchContext, stripe_jobs

log = logging.getLogger("insitubatch_nodes")


def window_decoder_for(device_decode: FrameDecoder, readers: Sequence[Reader],
                       arrays: Sequence[Any], stats: FetchStats) -> WindowDecoder:
    """The device decoder of the variables whose chain the device decodes; one log line
    for each variable that stays on the CPU, saying why."""
    chains: dict[int, DeviceChain] = {}
    plain = [r for r in readers
             if isinstance(r, StripeReader) and not isinstance(r, AxisStripeReader)]
    if len(plain) < len(readers):
        other = [r.geom.name for r in readers if r not in plain]
        raise ConfigError(f"variables {other} are composed of several stored arrays (a join "
                          "on other dates, a concat or a period), a part of the grid, or "
                          "sampled along a stored axis other than the first, which the GPU "
                          "decoder does not read: build the loader with decode='cpu'")
    for v, (reader, arr) in enumerate(zip(plain, arrays, strict=True)):
        chain = device_chain_for(arr)
        if isinstance(chain, HostOnly):
            log.warning("insitubatch: variable %r decodes on the CPU, not on %s: %s "
                        "(codec chain %s)", reader.geom.name, device_decode.device,
                        chain.reason, chain.chain)
        else:
            chains[v] = chain
    decoder = WindowDecoder(device_decode, plain, chains)
    decoder.times = stats.read
    return decoder


class DeviceSubmit(LoopSubmit):
    """``LoopSubmit`` whose gathered windows decode their device variables on the device
    thread. No window is read from the chunk cache on the pool: its frames are checked
    on this path."""

    def __init__(self, ctx: FetchContext, hold: FirstBatchHold, loop: FetchLoop,
                 decoder: WindowDecoder) -> None:
        super().__init__(ctx, hold, loop)
        self.window_decoder = decoder

    def all_cached(self, plan: ReadPlan) -> bool:
        return False

    async def read_frames(self, v: int, idxs: list[int]) -> list:
        """``read`` for a variable decoded on the device: its stored chunks, checked."""
        lt = self.loop.lt
        assert lt is not None
        reader = self.ctx.readers[v]
        chain = self.window_decoder.chains[v]
        nbytes = reader.chunk_nbytes
        async with self.slot():
            frames, _ = await reader.read_frames(
                idxs, lambda f: chain.check(f, nbytes), lt.loop, lt.pool, self.ctx.retry)
        self.ctx.stats.stripes_read(len(idxs), reader.geom.stripe_nbytes)
        return frames

    async def fetch_window(self, plan: ReadPlan) -> DecodedWindow:
        jobs = stripe_jobs(self.ctx, plan)
        wd = self.window_decoder
        on_device = wd.chains
        results = await gather_or_cancel(self.read_frames(v, idxs) if v in on_device
                                         else self.read(v, idxs) for v, idxs in jobs)
        arrays: tuple[dict[int, np.ndarray | torch.Tensor], ...] = tuple({} for _ in plan.reads)
        stripes: list[StripeFrames] = []
        for (v, idxs), bufs in zip(jobs, results, strict=True):
            for idx, buf in zip(idxs, bufs, strict=True):
                if v in on_device:
                    stripes.append(StripeFrames(v, idx, buf))
                else:
                    arrays[v][idx] = buf
        if stripes:
            lt = self.loop.lt
            assert lt is not None and lt.device_pool is not None
            try:
                tensors = await lt.loop.run_in_executor(lt.device_pool, wd.decode, stripes)
            except Exception as e:
                e.add_note(f"insitubatch: decoding {len(stripes)} stripes of the window of "
                           f"chunks {list(plan.chunk_ids)[:8]} on {wd.device} failed")
                raise
            for st, t in zip(stripes, tensors, strict=True):
                arrays[st.var][st.index] = t
        self.ctx.stats.window_fetched(len(plan.chunk_ids))
        return DecodedWindow(plan, arrays)
