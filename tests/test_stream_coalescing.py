"""A request's stream in the front: tokens that wait go out together, every token exactly once and in
order, with the same text and stop-string cut as one token at a time; the stream interval holds
messages back as set, but never the first token or the last; no message but the last has empty text
(a token ending inside a UTF-8 character waits for the rest). Real tokenizer, real asyncio, no server."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from tandem.service.contract import (
    ErrorKind,
    FinishReason,
    Request,
    RequestError,
    SamplingParams,
    TokenLogprob,
)
from tandem.service.server.request_stream import RequestStream, StreamInterval

PROMPT = "The story begins"
TEXT = " in a small town by the sea, where the fishermen told stories of the old lighthouse keeper."


@pytest.fixture(scope="module")
def tok(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


EVERY_TOKEN = StreamInterval()


def _stream(tok, interval=EVERY_TOKEN, stop=(), released=None, logprobs=False) -> RequestStream:
    params = SamplingParams(max_tokens=1000, stop=tuple(stop), logprobs=logprobs)
    sink = released if released is not None else []
    return RequestStream(Request("r", tok.encode(PROMPT), params), tok, interval, sink.append)


async def _read_while_feeding(
    stream: RequestStream, ids: list[int], every_s: float, burst: int = 1,
    finish: FinishReason = FinishReason.LENGTH, stop_token: int | None = None,
):
    """Feed `ids` `burst` at a time every `every_s` seconds as the engine would, then finish."""
    async def feed() -> None:
        for i in range(0, len(ids), burst):
            for t in ids[i : i + burst]:
                stream.token(t)
            if i + burst >= len(ids):
                stream.finish(finish, stop_token)
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


EMOJI_TEXT = " Sunny 🌞 with rain 🌧️ later 🙂🙂"


def test_no_message_but_the_last_has_empty_text(tok):
    """Tokens ending inside a UTF-8 character (an emoji spans several byte tokens) wait for the token
    that completes it: every message carries text, each token id goes out once, with its logprob."""
    ids = tok.encode(EMOJI_TEXT, add_special_tokens=False)
    stream = _stream(tok, logprobs=True)
    assert len(ids) > len(EMOJI_TEXT.split())  # the emoji are several tokens each

    async def main():
        chunks = []

        async def feed():
            for i, t in enumerate(ids):
                stream.token(t)
                stream.logprob(TokenLogprob(-float(i)))
                await asyncio.sleep(0.001)
            stream.finish(FinishReason.LENGTH, None)

        feeder = asyncio.ensure_future(feed())
        async for chunk in stream.chunks():
            chunks.append(chunk)
        await feeder
        return chunks

    chunks = asyncio.run(main())
    assert all(c.text for c in chunks[:-1]), [c.text for c in chunks]
    assert "".join(c.text for c in chunks) == EMOJI_TEXT
    assert [t for c in chunks for t in c.token_ids] == ids
    assert [lp.logprob for c in chunks for lp in c.logprobs] == [-float(i) for i in range(len(ids))]
    assert len(chunks) < len(ids)  # some tokens waited for the rest of their character


def test_an_end_of_sequence_sends_its_id_not_its_text_and_no_stop_reason(tok):
    """The engine ends a request on EOS or one of its stop_token_ids with FinishReason.STOP; the stop
    token's id is sent but not its text, and the stop reason is the stop token only where one of the
    request's stop_token_ids ended it (None for an end of sequence, as vLLM reports it)."""
    ids = tok.encode(" Hello there.", add_special_tokens=False)
    stop_id = tok.encode(" world", add_special_tokens=False)[0]

    for stop_token, reason in ((None, None), (stop_id, stop_id)):
        chunks = asyncio.run(_read_while_feeding(
            _stream(tok), [*ids, stop_id], 0.001, finish=FinishReason.STOP, stop_token=stop_token))
        last = chunks[-1][1]
        assert "".join(c.text for _, c in chunks) == " Hello there."
        assert [t for _, c in chunks for t in c.token_ids] == [*ids, stop_id]
        assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, reason)
