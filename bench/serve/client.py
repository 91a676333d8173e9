"""The client processes of `tandem bench serve` and `tandem bench soak`: the skeleton every kind of
client shares (gRPC and HTTP here, the soak's in soak/client.py), and the parent's side that starts
them together.

A client process connects first, says "ready", waits for the start signal that every client gets
at once, then sends its share: each stream its requests one after another (fixed concurrency), or
each request at its arrival time whatever is still running (request rate). Several such processes
run at once, so that the client is never what limits the server.

A kind of client is its `connect`: an async context manager, opened before "ready" (its
connections up), that yields `send(i, job)`, which sends one request (i: its stream's or arrival's
index) and returns what it recorded, a list. `connect` crosses to the process it runs in, so it is
a module-level function or a functools.partial of one.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field

TIMEOUT_S = 3600.0

Send = Callable[[int, dict], Awaitable[list]]
Connect = Callable[[], AbstractAsyncContextManager[Send]]


@dataclass
class Timed:
    """One request of `tandem bench serve` as its client saw it; times are wall clock (time.time())."""

    start: float
    prompt_tokens: int = 0
    first: float | None = None  # first message with tokens
    end: float | None = None
    tokens: int = 0
    messages: int = 0
    itl: list[float] = field(default_factory=list)  # per token after the first: the gap it waited
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache (its usage)
    error: str | None = None

    def received(self, n: int, last: float) -> float:
        """A message of `n` tokens arrived now, the previous one at `last`; returns now. The tokens
        of one message arrive together: the first waited the gap, the others none."""
        now = time.time()
        if self.first is None:
            self.first = now
            self.itl += [0.0] * (n - 1)
        else:
            self.itl += [now - last] + [0.0] * (n - 1)
        self.tokens += n
        self.messages += 1
        return now


async def run_jobs(streams: list[list[dict]], arrivals: list[dict], send: Send) -> list:
    """Fixed concurrency: each stream's requests one after another; request rate: each request at
    its arrival time (`at`, seconds after the start)."""
    start_at = time.time()
    results: list = []

    async def stream(i: int, jobs: list[dict]) -> None:
        for job in jobs:
            results.extend(await send(i, job))

    async def arrival(i: int, job: dict) -> None:
        await asyncio.sleep(max(0.0, start_at + job["at"] - time.time()))
        results.extend(await send(i, job))

    tasks = [stream(i, jobs) for i, jobs in enumerate(streams)]
    tasks += [arrival(i, job) for i, job in enumerate(arrivals)]
    await asyncio.gather(*tasks)
    return results


async def _main(connect: Connect, streams: list[list[dict]], arrivals: list[dict], go: object, out: object
                ) -> list[dict]:
    async with connect() as send:
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)  # every client starts at once
        results = await run_jobs(streams, arrivals, send)
    return [asdict(r) for r in results]


def run_client(connect: Connect, streams: list[list[dict]], arrivals: list[dict], go: object, out: object
               ) -> None:
    """Process entry point: "ready" once connected, then (after `go` is set) the records, on `out`."""
    out.put(asyncio.run(_main(connect, streams, arrivals, go, out)))


def shares(level: dict, clients: int) -> list[tuple[list[list[dict]], list[dict]]]:
    """Each client's (streams, arrivals) of a level: its streams (fixed concurrency) or its requests
    (request rate), dealt in turn."""
    dealt: list[tuple[list, list]] = [([], []) for _ in range(clients)]
    if level["mode"] == "concurrency":
        c = level["concurrency"]
        for i in range(c):
            dealt[i % clients][0].append(level["jobs"][i::c])
    else:
        for i, job in enumerate(level["jobs"]):
            dealt[i % clients][1].append(job)
    return [(s, r) for s, r in dealt if s or r]


def run_clients(
    connect: Connect, level: dict, clients: int, pin: Callable[[int], None] = lambda pid: None
) -> tuple[list[dict], float, float]:
    """One level through `clients` processes: (the requests as timed, start, end) in wall clock.
    `pin`: called with each client process's id once it runs (its CPUs: server.CpuSplit)."""
    ctx = multiprocessing.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=run_client, args=(connect, s, r, go, out)) for s, r in shares(level, clients)]
    for p in procs:
        p.start()
        pin(p.pid)
    for _ in procs:
        assert out.get(timeout=120) == "ready"
    start = time.time()
    go.set()
    results = [r for _ in procs for r in out.get(timeout=3600)]
    end = time.time()
    for p in procs:
        p.join()
    return results, start, end
