"""The HTTP client of `tandem bench serve --front http`: streams from the OpenAI-compatible HTTP
front (`POST /v1/completions`, server-sent events), each event timed as it arrives.

The same requests as the gRPC client (client_grpc.py): token-id prompts, greedy, `ignore_eos` so
that each runs to its `max_tokens`; `return_token_ids` (an extension) gives each event's token count,
as a gRPC message carries its token ids; `stream_options.include_usage` ends the stream with the
usage, whose `prompt_tokens_details.cached_tokens` says what the prefix cache held. One connection
per stream in flight (HTTP/1.1), which the kernel spreads over the server's fronts. Events are split
and decoded with msgspec into the fields read, so that the client is never what limits the server.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import msgspec

from tandem.bench.serve.client import TIMEOUT_S, Send, Timed


class _Choice(msgspec.Struct):
    token_ids: list[int] = []


class _PromptDetails(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens_details: _PromptDetails | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


_decode = msgspec.json.Decoder(_Event).decode


def _body(job: dict) -> dict:
    return {
        "prompt": job["prompt_ids"],
        "max_tokens": job["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


async def _one(session: aiohttp.ClientSession, url: str, job: dict) -> Timed:
    timed = Timed(start=time.time(), prompt_tokens=len(job["prompt_ids"]))
    last = timed.start
    try:
        async with session.post(url, json=_body(job)) as resp:
            if resp.status != 200:
                timed.error = f"HTTP {resp.status}"
            else:
                async for line in resp.content:  # "data: {...}\n", then the blank line ending the event
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].rstrip()
                    if data == b"[DONE]":
                        break
                    event = _decode(data)
                    if event.error is not None:
                        timed.error = str(event.error.get("code") or event.error.get("type"))
                        break
                    n = len(event.choices[0].token_ids) if event.choices else 0
                    if n:
                        last = timed.received(n, last)
                    if event.usage is not None and event.usage.prompt_tokens_details is not None:
                        timed.cached_tokens = event.usage.prompt_tokens_details.cached_tokens
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        timed.error = type(exc).__name__
    timed.end = time.time()
    return timed


@asynccontextmanager
async def connect(base_url: str, channels: int, tls_ca: str | None = None) -> AsyncIterator[Send]:
    """A session on the server at `base_url` (`channels` unused: a connection per stream)."""
    context = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    connector = aiohttp.TCPConnector(limit=0, ssl=context if context is not None else True)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(f"{base_url}/ready") as resp:
            assert resp.status == 200, f"{base_url}/ready answered {resp.status}"
        url = f"{base_url}/v1/completions"

        async def send(_: int, job: dict) -> list[Timed]:
            return [await _one(session, url, job)]

        yield send
