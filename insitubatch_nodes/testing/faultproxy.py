"""A fault-injecting HTTP proxy on loopback, for testing the remote read path.

It sits between obstore and the S3 server and, per request: adds latency; answers a chosen
fraction of chunk GETs with 503/500; resets the connection mid-body; truncates bodies (with a
matching Content-Length, so only decoding notices); stalls longer than the client's timeout;
and always fails chosen keys. A request's fault is drawn from (seed, path, how many times
that path was asked before), not from one stream shared by all requests: each key meets the
same faults in the same order however the requests interleave, so a test's outcome does not
hang on timing (with one shared stream, a key retried alone at an epoch's tail met whatever
cluster of faults the stream held there). It stops by itself after ``max_requests`` or
``max_seconds``, so a broken test cannot leave it running.
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import threading
import time
from dataclasses import dataclass, field

from ..errors import TestServerError

_CHUNK = re.compile(r"/c[/.]\d")
# a Zarr v2 chunk key's last part: "0.0.0" (or "0/0/0" with dimension_separator "/")
_V2_CHUNK = re.compile(r"/\d+(\.\d+)*(\?|$)")


@dataclass(frozen=True)
class FaultPlan:
    latency_s: float = 0.0
    error_rate: float = 0.0  # answered 503 or 500
    reset_rate: float = 0.0  # headers + half the body, then a connection reset
    truncate_rate: float = 0.0  # half the body, Content-Length to match
    stall_first: int = 0  # the first N chunk GETs stall for stall_s
    stall_s: float = 0.0
    always_fail: tuple[str, ...] = ()  # path substrings always answered 503
    chunks_only: bool = True  # faults hit chunk keys, never metadata
    seed: int = 0
    max_requests: int = 200_000
    max_seconds: float = 900.0


@dataclass
class FaultStats:
    requests: int = 0
    errors: int = 0
    resets: int = 0
    truncations: int = 0
    stalls: int = 0
    always_failed: int = 0
    chunk_gets: int = 0  # GETs of chunk keys (v3 "c/..." or v2 "0.0.0") answered
    chunk_bytes: int = 0  # the bytes of their bodies: what a partial fetch saves
    paths: list[str] = field(default_factory=list)


class FaultProxy:
    """Forward HTTP/1.1 requests to ``upstream`` (host, port) with the faults of ``plan``."""

    def __init__(self, upstream: tuple[str, int], plan: FaultPlan) -> None:
        self.upstream = upstream
        self.plan = plan
        self.stats = FaultStats()
        self._asked: collections.Counter[str] = collections.Counter()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._started = time.monotonic()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TestServerError("fault proxy did not start within 10 s")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._loop.call_later(self.plan.max_seconds, self._loop.stop)  # stops by itself
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for t in asyncio.all_tasks(self._loop):
                t.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP -----------------------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = [ln for ln in lines[1:] if ln]
                length = next((int(h.split(":", 1)[1]) for h in headers
                               if h.lower().startswith("content-length:")), 0)
                body = await reader.readexactly(length) if length else b""
                if not await self._serve(method, path, headers, body, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            if not writer.is_closing():
                writer.close()

    async def _serve(self, method: str, path: str, headers: list[str], body: bytes,
                     writer: asyncio.StreamWriter) -> bool:
        plan, st = self.plan, self.stats
        st.requests += 1
        if st.requests > plan.max_requests:
            self._loop.call_soon(self._loop.stop)
            return False
        if plan.latency_s:
            await asyncio.sleep(plan.latency_s)
        target = method == "GET" and (not plan.chunks_only or _CHUNK.search(path) is not None)
        if target and any(s in path for s in plan.always_fail):
            st.always_failed += 1
            st.paths.append(path)
            await self._error(writer, 503)
            return True
        fault, code = None, 503
        if target:
            if st.stalls < plan.stall_first:
                st.stalls += 1
                await asyncio.sleep(plan.stall_s)
                return False
            rng = random.Random(f"{plan.seed}:{method}:{path}:{self._asked[path]}")
            self._asked[path] += 1
            x, code = rng.random(), rng.choice((503, 500))
            rates = (("error", plan.error_rate), ("reset", plan.reset_rate),
                     ("truncate", plan.truncate_rate))
            for name, rate in rates:
                if x < rate:
                    fault = name
                    break
                x -= rate
        if fault == "error":
            st.errors += 1
            await self._error(writer, code)
            return True
        status, rheaders, rbody = await self._forward(method, path, headers, body)
        if method == "GET" and (_CHUNK.search(path) or _V2_CHUNK.search(path)):
            st.chunk_gets += 1
            st.chunk_bytes += len(rbody)
        if fault == "reset" and len(rbody) > 1:
            st.resets += 1
            writer.write(self._head(status, rheaders, len(rbody)) + rbody[: len(rbody) // 2])
            await writer.drain()
            writer.transport.abort()
            return False
        if fault == "truncate" and len(rbody) > 1:
            st.truncations += 1
            rbody = rbody[: len(rbody) // 2]
        writer.write(self._head(status, rheaders, len(rbody)) + rbody)
        await writer.drain()
        return True

    async def _forward(self, method: str, path: str, headers: list[str],
                       body: bytes) -> tuple[str, list[str], bytes]:
        r, w = await asyncio.open_connection(*self.upstream)
        kept = [h for h in headers if not h.lower().startswith("connection:")]
        w.write(("\r\n".join([f"{method} {path} HTTP/1.1", *kept, "Connection: close"])
                 + "\r\n\r\n").encode("latin-1") + body)
        await w.drain()
        raw = await r.read()
        w.close()
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        rheaders = [h for h in lines[1:] if h and not h.lower().startswith(
            ("content-length:", "connection:", "transfer-encoding:"))]
        if any(h.lower().startswith("transfer-encoding:") and "chunked" in h.lower()
               for h in lines[1:]):
            rest = _dechunk(rest)
        if method == "HEAD":
            length = next((h.split(":", 1)[1].strip() for h in lines[1:]
                           if h.lower().startswith("content-length:")), "0")
            rheaders.append(f"Content-Length: {length}")
            return lines[0], rheaders, b""
        return lines[0], rheaders, rest

    @staticmethod
    def _head(status: str, headers: list[str], length: int) -> bytes:
        hs = [h for h in headers if not h.lower().startswith("content-length:")]
        return ("\r\n".join([status, *hs, f"Content-Length: {length}", "Connection: keep-alive"])
                + "\r\n\r\n").encode("latin-1")

    async def _error(self, writer: asyncio.StreamWriter, code: int) -> None:
        reason = {503: "Service Unavailable", 500: "Internal Server Error"}[code]
        body = (f"<?xml version=\"1.0\"?><Error><Code>{'SlowDown' if code == 503 else 'Internal'}"
                f"</Code><Message>injected by the fault proxy</Message></Error>").encode()
        writer.write(self._head(f"HTTP/1.1 {code} {reason}", ["Content-Type: application/xml"],
                                len(body)) + body)
        await writer.drain()


def _dechunk(data: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        j = data.index(b"\r\n", i)
        size = int(data[i:j].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[j + 2 : j + 2 + size]
        i = j + 2 + size + 2
