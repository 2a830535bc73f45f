"""The streaming HTTP clients of `qfuse bench serve`, in a process of their own.

A load is a list of `/v1/completions` request bodies, all sent at once: one asyncio task
each, streaming its response through httpx and recording when it sent the request, when
each text chunk arrived and the usage the stream reported. The tasks run in a child
process (`Clients`), not in the server's: parsing thousands of chunks a second would
otherwise take the interpreter lock from the server's event loop and the engine's
thread, and slow down what is measured. Every time is the child's `time.perf_counter()`,
so the figures only ever compare times taken in one process.

Bounded: a load that has not finished within its timeout is cancelled in the child (its
streams closed, so the server cancels their requests); a child that does not answer
within the timeout and a margin is killed. Either way the parent gets TimeoutError.
This module imports only the standard library and httpx, so the child starts quickly.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time

MARGIN_S = 15.0  # past a load's timeout, for the child to cancel its streams and answer


def httpx_module():
    try:
        import httpx
    except ImportError:  # the openai client's newer releases bring httpx2, the same API
        import httpx2 as httpx
    return httpx


async def _stream(client, url: str, body: dict) -> dict:
    """One streaming completion: send time, each text chunk's arrival, usage, the text."""
    sent = time.perf_counter()
    arrivals, usage, texts = [], None, []
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
            if text:
                arrivals.append(time.perf_counter())
                texts.append(text)
    if not arrivals:
        raise RuntimeError("a stream ended without any text")
    return {"sent": sent, "arrivals": arrivals, "text": "".join(texts),
            "completion_tokens": usage["completion_tokens"] if usage else len(arrivals)}


async def drive(port: int, bodies: list[dict], timeout_s: float) -> list[dict]:
    """Every body as a streaming completion, all at once; each stream's timings.
    TimeoutError (the streams cancelled) past ``timeout_s``."""
    httpx = httpx_module()
    url = f"http://127.0.0.1:{port}/v1/completions"
    n = len(bodies)
    limits = httpx.Limits(max_connections=n + 2, max_keepalive_connections=n + 2)
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(_stream(client, url, {**b, **stream}) for b in bodies)), timeout_s)


def _worker(conn) -> None:
    """The child's loop: (port, bodies, timeout_s) in, (True, streams) or (False, why)
    out; None ends it."""
    while True:
        job = conn.recv()
        if job is None:
            return
        port, bodies, timeout_s = job
        try:
            answer = (True, asyncio.run(drive(port, bodies, timeout_s)))
        except TimeoutError:
            why = f"the load of {len(bodies)} streams did not finish within {timeout_s:.0f} s"
            answer = (False, why)
        except Exception as e:  # noqa: BLE001 -- reported to the parent, which records it
            answer = (False, f"{type(e).__name__}: {e}")
        conn.send(answer)


class Clients:
    """A child process that runs loads (`run`) until `close`; a child killed for not
    answering is replaced by a fresh one at the next load."""

    def __init__(self):
        self._proc = self._conn = None

    def _start(self) -> None:
        # spawn: a fork of a process with CUDA and several threads is unsafe.
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child,), name="qfuse-bench-clients",
                                 daemon=True)
        self._proc.start()
        child.close()

    def run(self, port: int, bodies: list[dict], timeout_s: float) -> list[dict]:
        """Each stream's timings (`drive`); TimeoutError past ``timeout_s``, RuntimeError
        for a load that failed otherwise (a status, an error event, a stream cut)."""
        if self._proc is None:
            self._start()
        self._conn.send((port, bodies, timeout_s))
        if not self._conn.poll(timeout_s + MARGIN_S):
            self.close()  # it is stuck itself: nothing it says later can be trusted
            raise TimeoutError(f"the clients did not answer within {timeout_s + MARGIN_S:.0f} s")
        ok, value = self._conn.recv()
        if ok:
            return value
        if value.startswith("the load of"):
            raise TimeoutError(value)
        raise RuntimeError(value)

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
        self._proc = self._conn = None
