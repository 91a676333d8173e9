"""A request's stream in the front: tokens that wait go out together, every token exactly once and in
order, with the same text and stop-string cut as one token at a time; the stream interval holds
messages back as set, but never the first token or the last. Real tokenizer, real asyncio, no server."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from tandem.service.engine.errors import ErrorKind, RequestError
from tandem.service.engine.sampling_params import SamplingParams
from tandem.service.engine.sequence import FinishReason
from tandem.service.server.request_stream import RequestStream, StreamInterval

PROMPT = "The story begins"
TEXT = " in a small town by the sea, where the fishermen told stories of the old lighthouse keeper."


@pytest.fixture(scope="module")
def tok(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


EVERY_TOKEN = StreamInterval()


def _stream(tok, interval=EVERY_TOKEN, stop=(), released=None) -> RequestStream:
    params = SamplingParams(max_tokens=1000, stop=tuple(stop))
    sink = released if released is not None else []
    return RequestStream("r", tok.encode(PROMPT), params, tok, interval, sink.append)


async def _read_while_feeding(stream: RequestStream, ids: list[int], every_s: float, burst: int = 1):
    """Feed `ids` `burst` at a time every `every_s` seconds as the engine would, then finish."""
    async def feed() -> None:
        for i in range(0, len(ids), burst):
            for t in ids[i : i + burst]:
                stream.token(t)
            if i + burst >= len(ids):
                stream.finish(FinishReason.LENGTH, None)
            await asyncio.sleep(every_s)

    feeder = asyncio.ensure_future(feed())
    chunks = []
    async for chunk in stream.chunks():
        chunks.append((time.monotonic(), chunk))
    await feeder
    return chunks


def test_a_backlog_goes_out_in_one_message_with_every_token_once(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    released: list[RequestStream] = []
    stream = _stream(tok, released=released)

    async def main():
        for t in ids:  # everything arrived before the reader got its turn
            stream.token(t)
        stream.finish(FinishReason.LENGTH, None)
        return [c async for c in stream.chunks()]

    chunks = asyncio.run(main())
    assert len(chunks) == 1
    assert chunks[0].token_ids == ids and chunks[0].text == TEXT
    assert chunks[0].finish_reason is FinishReason.LENGTH and chunks[0].completion_tokens == len(ids)
    assert released == [stream]


@pytest.mark.parametrize("burst", [1, 3, 8])
def test_coalesced_tokens_arrive_in_order_with_the_same_text(tok, burst):
    ids = tok.encode(TEXT, add_special_tokens=False)
    chunks = asyncio.run(_read_while_feeding(_stream(tok, StreamInterval(tokens=4)), ids, 0.002, burst))
    got = [t for _, c in chunks for t in c.token_ids]
    assert got == ids
    assert "".join(c.text for _, c in chunks) == TEXT
    assert chunks[-1][1].completion_tokens == len(ids)
    # every message but the first (TTFT) and the last carries at least `tokens` tokens
    assert all(len(c.token_ids) >= 4 for _, c in chunks[1:-1])
    assert len(chunks[0][1].token_ids) <= burst


def test_the_interval_in_seconds_spaces_messages_but_never_delays_the_first(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    interval = StreamInterval(tokens=1, seconds=0.05)
    start = time.monotonic()
    chunks = asyncio.run(_read_while_feeding(_stream(tok, interval), ids, 0.005))
    assert [t for _, c in chunks for t in c.token_ids] == ids
    assert chunks[0][0] - start < 0.04  # the first token goes at once
    sent = [t for t, _ in chunks]
    gaps = [b - a for a, b in zip(sent[:-1], sent[1:-1], strict=False)]  # the last one is never held
    assert gaps and min(gaps) >= 0.045
    assert len(chunks) < len(ids) / 3


def test_a_stop_string_in_a_coalesced_batch_ends_where_it_would_token_by_token(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)

    def run(interval: StreamInterval, burst: int):
        stream = _stream(tok, interval, stop=["lighthouse"])
        chunks = asyncio.run(_read_while_feeding(stream, ids, 0.001, burst))
        return [t for _, c in chunks for t in c.token_ids], "".join(c.text for _, c in chunks), chunks[-1][1]

    one_by_one = run(StreamInterval(), 1)
    batched = run(StreamInterval(tokens=16), 16)
    assert batched[:2] == one_by_one[:2]
    assert batched[1] == TEXT[: TEXT.index("lighthouse")]
    assert batched[2].finish_reason is FinishReason.STOP and batched[2].stop_reason == "lighthouse"
    assert len(batched[0]) < len(ids)


def test_a_failure_ends_the_stream_with_its_status(tok):
    stream = _stream(tok)

    async def main():
        stream.token(tok.encode(" Hi", add_special_tokens=False)[0])
        stream.fail(RequestError(ErrorKind.UNAVAILABLE, "the engine process has stopped"))
        return [c async for c in stream.chunks()]

    with pytest.raises(RequestError) as err:
        asyncio.run(main())
    assert err.value.kind is ErrorKind.UNAVAILABLE
