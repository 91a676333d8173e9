"""The gRPC client of `tandem bench serve`: `GenerateStream` calls, each message timed as it
arrives, the server's usage of the prompt (its cached tokens) read from the final message.

Several connections per client process (`channels`), so that the server's front processes
(SO_REUSEPORT) each get some; the process skeleton is serve/client.py's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from tandem import connect as connections
from tandem.bench.serve.client import TIMEOUT_S, Send, Timed
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc


def _request(job: dict) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=job["prompt_ids"]),
        stopping=pb.StoppingCriteria(max_tokens=job["max_tokens"], ignore_eos=True),
    )


async def _one(stub: pb_grpc.TandemStub, job: dict) -> Timed:
    timed = Timed(start=time.time(), prompt_tokens=len(job["prompt_ids"]))
    last = timed.start
    try:
        async for msg in stub.GenerateStream(_request(job), timeout=TIMEOUT_S):
            if msg.token_ids:
                last = timed.received(len(msg.token_ids), last)
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:  # the last message carries the usage
                timed.cached_tokens = msg.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as err:
        timed.error = err.code().name
    timed.end = time.time()
    return timed


@asynccontextmanager
async def connect(address: str, channels: int, tls_ca: str | None = None) -> AsyncIterator[Send]:
    """`channels` connections to the server at `address` (TLS trusting `tls_ca` where given)."""
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 * 1024**2)]
    creds = connections.credentials(tls_ca)
    chans = [connections.aio_channel(address, creds, opts) for _ in range(channels)]
    stubs = [pb_grpc.TandemStub(c) for c in chans]
    for c in chans:
        await c.channel_ready()

    async def send(i: int, job: dict) -> list[Timed]:
        return [await _one(stubs[i % len(stubs)], job)]

    try:
        yield send
    finally:
        for c in chans:
            await c.close()
