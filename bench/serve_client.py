"""One client process of `tandem bench serve`: streams its share of the requests over gRPC and times
every message it receives.

Fixed concurrency: each of its streams sends its requests one after another. Request rate: each
request is sent at its arrival time, whatever is still running. Several such processes run at once,
so that the client is never what limits the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import _repo  # noqa: F401  (tandem.v1 from this checkout)
import grpc

from tandem import connect
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

TIMEOUT_S = 3600.0


@dataclass
class Timed:
    """One request as its client saw it; times are wall clock (time.time())."""

    start: float
    first: float | None = None  # first message with tokens
    end: float | None = None
    tokens: int = 0
    messages: int = 0
    itl: list[float] = field(default_factory=list)  # per token after the first: the gap it waited
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


async def run_jobs(
    streams: list[list[dict]], arrivals: list[dict], one: Callable[[int, dict], Awaitable[Timed]]
) -> list[Timed]:
    """Fixed concurrency: each stream's requests one after another; request rate: each request at
    its arrival time. `one(i, job)` sends a request (i: its stream's or arrival's index)."""
    start_at = time.time()
    results: list[Timed] = []

    async def stream(i: int, jobs: list[dict]) -> None:
        for job in jobs:
            results.append(await one(i, job))

    async def arrival(i: int, job: dict) -> None:
        await asyncio.sleep(max(0.0, start_at + job["at"] - time.time()))
        results.append(await one(i, job))

    tasks = [stream(i, jobs) for i, jobs in enumerate(streams)]
    tasks += [arrival(i, job) for i, job in enumerate(arrivals)]
    await asyncio.gather(*tasks)
    return results


def _request(job: dict) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=job["prompt_ids"]),
        stopping=pb.StoppingCriteria(max_tokens=job["max_tokens"], ignore_eos=True),
    )


async def _one(stub: pb_grpc.TandemStub, job: dict) -> Timed:
    timed = Timed(start=time.time())
    last = timed.start
    try:
        async for msg in stub.GenerateStream(_request(job), timeout=TIMEOUT_S):
            if msg.token_ids:
                last = timed.received(len(msg.token_ids), last)
    except grpc.aio.AioRpcError as err:
        timed.error = err.code().name
    timed.end = time.time()
    return timed


async def _main(
    address: str,
    streams: list[list[dict]],
    arrivals: list[dict],
    go: object,
    channels: int,
    out: object,
    tls_ca: str | None,
) -> list[dict]:
    # separate connections, so that the server's fronts (SO_REUSEPORT) each get some
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 * 1024**2)]
    creds = connect.credentials(tls_ca)
    chans = [connect.aio_channel(address, creds, opts) for _ in range(channels)]
    stubs = [pb_grpc.TandemStub(c) for c in chans]
    for c in chans:
        await c.channel_ready()
    out.put("ready")
    await asyncio.get_running_loop().run_in_executor(None, go.wait)  # every client starts at once
    results = await run_jobs(streams, arrivals, lambda i, job: _one(stubs[i % len(stubs)], job))
    for c in chans:
        await c.close()
    return [asdict(r) for r in results]


def run_client(
    address: str,
    streams: list[list[dict]],
    arrivals: list[dict],
    go: object,
    channels: int,
    out: object,
    tls_ca: str | None = None,
) -> None:
    """Process entry point: "ready" once connected, then (after `go` is set) the results, on `out`.
    `tls_ca`: connect with TLS, trusting this CA."""
    out.put(asyncio.run(_main(address, streams, arrivals, go, channels, out, tls_ca)))
