"""One client process of `tandem bench serve --front http`: streams its share of the requests from
the OpenAI-compatible HTTP front (`POST /v1/completions`, server-sent events) and times every event.

The same requests as the gRPC client (serve_client.py): token-id prompts, greedy, `ignore_eos` so
that each runs to its `max_tokens`; `return_token_ids` (an extension) gives each event's token count,
as a gRPC message carries its token ids. One connection per stream in flight (HTTP/1.1), which the
kernel spreads over the server's fronts. Events are split and decoded with msgspec into the one
field read, so that the client is never what limits the server.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import asdict

import aiohttp
import msgspec
from serve_client import TIMEOUT_S, Timed, run_jobs


class _Choice(msgspec.Struct):
    token_ids: list[int] = []


class _Event(msgspec.Struct):
    choices: list[_Choice] = []
    error: dict | None = None


_decode = msgspec.json.Decoder(_Event).decode


def _body(job: dict) -> dict:
    return {
        "prompt": job["prompt_ids"],
        "max_tokens": job["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


async def _one(session: aiohttp.ClientSession, url: str, job: dict) -> Timed:
    timed = Timed(start=time.time())
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
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        timed.error = type(exc).__name__
    timed.end = time.time()
    return timed


async def _main(
    base_url: str,
    streams: list[list[dict]],
    arrivals: list[dict],
    go: object,
    out: object,
    tls_ca: str | None,
) -> list[dict]:
    context = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    connector = aiohttp.TCPConnector(limit=0, ssl=context if context is not None else True)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(f"{base_url}/ready") as resp:
            assert resp.status == 200, f"{base_url}/ready answered {resp.status}"
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)  # every client starts at once
        url = f"{base_url}/v1/completions"
        results = await run_jobs(streams, arrivals, lambda _, job: _one(session, url, job))
    return [asdict(r) for r in results]


def run_http_client(
    base_url: str,
    streams: list[list[dict]],
    arrivals: list[dict],
    go: object,
    channels: int,
    out: object,
    tls_ca: str | None = None,
) -> None:
    """Process entry point, as serve_client.run_client's (`channels` unused: a connection per stream)."""
    out.put(asyncio.run(_main(base_url, streams, arrivals, go, out, tls_ca)))
