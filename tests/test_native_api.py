"""The native `tandem.v1.Tandem` API over a real `tandem serve` process and a real gRPC client.

One server with the tiny random llama model (the session's, conftest.tiny_server) serves the module
(greedy output of a random model is deterministic, which is all these tests need); one test starts
the real embedded SmolLM2-135M-Instruct and checks that it knows the capital of France.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from serverproc import TINY_SERVER_KV_BLOCKS, TINY_SERVER_MODEL, ServerFactory, wait_idle
from transformers import AutoTokenizer

from tandem.service.models.loader import default_cache_dir
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MODEL_NAME = TINY_SERVER_MODEL
NUM_KV_BLOCKS = TINY_SERVER_KV_BLOCKS
TIMEOUT = 60.0

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
CHAT = [
    pb.ChatMessage(role="system", content="You are a terse assistant."),
    pb.ChatMessage(role="user", content="Name three colours."),
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(tiny_server: str) -> str:
    return tiny_server  # conftest's: the tiny llama as MODEL_NAME with NUM_KV_BLOCKS


@pytest.fixture(scope="module")
def stub(server: str) -> Iterator[pb_grpc.TandemStub]:
    with grpc.insecure_channel(server) as channel:
        yield pb_grpc.TandemStub(channel)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


# -- helpers ------------------------------------------------------------------------------------


def request(
    *,
    text: str | None = None,
    chat: list[pb.ChatMessage] | None = None,
    token_ids: list[int] | None = None,
    max_tokens: int = 16,
    ignore_eos: bool = True,
    **kwargs,
) -> pb.GenerateRequest:
    stopping = pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=ignore_eos)
    req = pb.GenerateRequest(stopping=stopping, **kwargs)
    if text is not None:
        req.text = text
    if chat is not None:
        req.chat.messages.extend(chat)
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    return req


def stream_all(stub: pb_grpc.TandemStub, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.GenerateStream(req, timeout=TIMEOUT))


def merge(messages: list[pb.GenerateResponse]) -> tuple[str, list[int]]:
    return "".join(m.text for m in messages), [t for m in messages for t in m.token_ids]


def prompt_ids(stub: pb_grpc.TandemStub) -> list[int]:
    """PROMPT as the server tokenizes a text input (with special tokens)."""
    resp = stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=True), timeout=TIMEOUT)
    return list(resp.token_ids)


def inputs() -> dict[str, dict]:
    return {"text": {"text": PROMPT}, "chat": {"chat": CHAT}}


# -- metadata -----------------------------------------------------------------------------------


def test_model_info(stub: pb_grpc.TandemStub, tokenizer) -> None:
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=TIMEOUT)
    assert info.model == MODEL_NAME
    assert info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == len(tokenizer)
    assert info.max_context_length == 1024  # the tiny config's max_position_embeddings
    assert info.dtype == "float32"
    assert info.device == "cpu"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in info.eos_token_ids
    assert list(info.eos_token_ids) == sorted(info.eos_token_ids)
    assert info.has_chat_template
    assert info.source


def test_tokenize_text_and_chat(stub: pb_grpc.TandemStub, tokenizer) -> None:
    for special in (False, True):
        resp = stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=special), timeout=TIMEOUT)
        assert list(resp.token_ids) == tokenizer.encode(PROMPT, add_special_tokens=special)
        assert list(resp.tokens) == tokenizer.convert_ids_to_tokens(list(resp.token_ids))

    chat = pb.TokenizeRequest()
    chat.chat.messages.extend(CHAT)
    resp = stub.Tokenize(chat, timeout=TIMEOUT)
    expected = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in CHAT], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(list(resp.token_ids)) == expected
    assert len(resp.tokens) == len(resp.token_ids)


def test_get_load_idle(stub: pb_grpc.TandemStub) -> None:
    load = wait_idle(stub)
    assert load.kv_blocks_total == NUM_KV_BLOCKS
    assert load.kv_cache_usage == pytest.approx(0.0)
    assert 0.0 <= load.gpu_idle_fraction <= 1.0


# -- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["text", "chat", "token_ids"])
def test_generate_unary_and_stream_agree(stub: pb_grpc.TandemStub, kind: str) -> None:
    if kind == "token_ids":
        ids = prompt_ids(stub)
        given: dict = {"token_ids": ids}
        prompt_tokens = len(ids)
    else:
        given = inputs()[kind]
        tok_req = pb.TokenizeRequest(add_special_tokens=True)
        if kind == "text":
            tok_req.text = PROMPT
        else:
            tok_req.chat.messages.extend(CHAT)
        prompt_tokens = len(stub.Tokenize(tok_req, timeout=TIMEOUT).token_ids)

    unary = stub.Generate(request(max_tokens=20, request_id=f"unary-{kind}", **given), timeout=TIMEOUT)
    assert unary.request_id == f"unary-{kind}"
    assert unary.model == MODEL_NAME
    assert len(unary.token_ids) == 20
    assert unary.finish_reason == pb.FINISH_REASON_LENGTH
    assert unary.usage.prompt_tokens == prompt_tokens
    assert unary.usage.completion_tokens == len(unary.token_ids)
    assert unary.text

    messages = stream_all(stub, request(max_tokens=20, request_id=f"stream-{kind}", **given))
    assert len(messages) > 1
    text, ids = merge(messages)
    assert text == unary.text
    assert ids == list(unary.token_ids)
    assert all(m.request_id == f"stream-{kind}" for m in messages)
    # only the last message finishes and carries usage
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert all(not m.HasField("usage") for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == prompt_tokens
    assert last.usage.completion_tokens == 20


def test_token_ids_input_matches_text_input(stub: pb_grpc.TandemStub) -> None:
    ids = prompt_ids(stub)
    by_text = stub.Generate(request(text=PROMPT, max_tokens=12), timeout=TIMEOUT)
    by_ids = stub.Generate(request(token_ids=ids, max_tokens=12), timeout=TIMEOUT)
    assert list(by_ids.token_ids) == list(by_text.token_ids)
    assert by_ids.text == by_text.text


def test_request_id_generated_when_empty(stub: pb_grpc.TandemStub) -> None:
    futures = [stub.Generate.future(request(text=PROMPT, max_tokens=8), timeout=TIMEOUT) for _ in range(3)]
    ids = set()
    for f in futures:
        resp = f.result()
        assert len(resp.token_ids) == 8
        assert resp.request_id
        ids.add(resp.request_id)
    assert len(ids) == 3  # concurrent anonymous requests get distinct ids
    messages = stream_all(stub, request(text=PROMPT, max_tokens=4))
    assert messages[0].request_id and {m.request_id for m in messages} == {messages[0].request_id}


def test_finish_length_at_max_tokens(stub: pb_grpc.TandemStub) -> None:
    for n in (1, 7):
        resp = stub.Generate(request(text=PROMPT, max_tokens=n), timeout=TIMEOUT)
        assert resp.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(resp.token_ids) == n
        assert resp.usage.completion_tokens == n
        assert resp.stop_reason == ""


def _pick_stop_string(text: str) -> str:
    """A short piece from the middle of `text` that first occurs after its start."""
    for k in range(len(text) // 3, len(text) - 2):
        s = text[k : k + 2]
        if s.strip() and "\ufffd" not in s and text.find(s) > 0:
            return s
    pytest.fail(f"no usable stop string in {text!r}")


def test_finish_stop_on_stop_string(stub: pb_grpc.TandemStub) -> None:
    full = stub.Generate(request(text=PROMPT, max_tokens=32), timeout=TIMEOUT)
    stop = _pick_stop_string(full.text)
    expected = full.text[: full.text.find(stop)]

    resp = stub.Generate(_with_stop(stop), timeout=TIMEOUT)
    assert resp.finish_reason == pb.FINISH_REASON_STOP
    assert resp.stop_reason == stop
    assert stop not in resp.text
    assert resp.text == expected
    assert len(resp.token_ids) < 32
    assert resp.usage.completion_tokens == len(resp.token_ids)
    assert list(resp.token_ids) == list(full.token_ids[: len(resp.token_ids)])

    messages = stream_all(stub, _with_stop(stop))
    text, ids = merge(messages)
    assert text == expected
    assert ids == list(resp.token_ids)
    assert messages[-1].finish_reason == pb.FINISH_REASON_STOP
    assert messages[-1].stop_reason == stop


def _with_stop(stop: str) -> pb.GenerateRequest:
    req = request(text=PROMPT, max_tokens=32)
    req.stopping.stop.append(stop)
    return req


def test_finish_stop_on_stop_token_id(stub: pb_grpc.TandemStub, tokenizer) -> None:
    full = stub.Generate(request(text=PROMPT, max_tokens=24), timeout=TIMEOUT)
    ids = list(full.token_ids)
    stop_id = ids[5]
    cut = ids.index(stop_id)  # the first occurrence ends generation

    req = request(text=PROMPT, max_tokens=24)
    req.stopping.stop_token_ids.append(stop_id)
    resp = stub.Generate(req, timeout=TIMEOUT)
    assert resp.finish_reason == pb.FINISH_REASON_STOP
    assert list(resp.token_ids) == ids[: cut + 1]  # the stop token is returned ...
    # ... but its text is not: the text is that of the tokens before it
    before = stub.Generate(request(text=PROMPT, max_tokens=cut), timeout=TIMEOUT).text if cut else ""
    assert resp.text == before
    assert resp.stop_reason == tokenizer.convert_ids_to_tokens(stop_id)
    assert resp.usage.completion_tokens == cut + 1


def test_logprobs_with_top_logprobs(stub: pb_grpc.TandemStub, tokenizer) -> None:
    req = request(text=PROMPT, max_tokens=10, logprobs=pb.LogprobsOptions(enabled=True, top_logprobs=5))
    resp = stub.Generate(req, timeout=TIMEOUT)
    assert len(resp.logprobs) == len(resp.token_ids) == 10
    for tid, lp in zip(resp.token_ids, resp.logprobs, strict=True):
        assert lp.token_id == tid
        assert lp.token == tokenizer.convert_ids_to_tokens(tid)
        assert math.isfinite(lp.logprob) and lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 5
        values = [t.logprob for t in lp.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0.0 for v in values)
        assert values[0] >= lp.logprob - 1e-5
        # greedy: the chosen token is the most likely one
        assert lp.top_logprobs[0].token_id == tid
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert len({t.token_id for t in lp.top_logprobs}) == 5
        assert all(t.token == tokenizer.convert_ids_to_tokens(t.token_id) for t in lp.top_logprobs)

    # streamed logprobs: one per token, the same values
    messages = stream_all(stub, req)
    streamed = [lp for m in messages for lp in m.logprobs]
    assert [lp.token_id for lp in streamed] == list(resp.token_ids)
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in resp.logprobs], abs=1e-4)

    # enabled without top_logprobs: chosen-token logprobs only; off: none
    plain = stub.Generate(request(text=PROMPT, max_tokens=4, logprobs=pb.LogprobsOptions(enabled=True)),
                          timeout=TIMEOUT)
    assert len(plain.logprobs) == 4 and all(not lp.top_logprobs for lp in plain.logprobs)
    assert not stub.Generate(request(text=PROMPT, max_tokens=4), timeout=TIMEOUT).logprobs


def test_logprobs_when_sampling(stub: pb_grpc.TandemStub) -> None:
    req = request(text=PROMPT, max_tokens=10, logprobs=pb.LogprobsOptions(enabled=True, top_logprobs=3),
                  sampling=pb.SamplingParams(temperature=1.0, seed=7))
    resp = stub.Generate(req, timeout=TIMEOUT)
    for lp in resp.logprobs:
        assert lp.logprob <= 0.0
        assert lp.top_logprobs[0].logprob >= lp.logprob - 1e-5
        values = [t.logprob for t in lp.top_logprobs]
        assert values == sorted(values, reverse=True)


def _seeded(seed: int) -> pb.GenerateRequest:
    return request(text=PROMPT, max_tokens=32, sampling=pb.SamplingParams(temperature=1.0, seed=seed))


def test_seeded_sampling_is_reproducible_across_batches(stub: pb_grpc.TandemStub) -> None:
    alone = list(stub.Generate(_seeded(1234), timeout=TIMEOUT).token_ids)
    assert len(alone) == 32
    greedy = list(stub.Generate(request(text=PROMPT, max_tokens=32), timeout=TIMEOUT).token_ids)
    assert alone != greedy, "temperature 1.0 should not reproduce the greedy answer"
    other_seed = list(stub.Generate(_seeded(4321), timeout=TIMEOUT).token_ids)
    assert other_seed != alone

    # again, this time with batch mates that are already generating when it arrives
    mates = [
        stub.GenerateStream(
            request(text=f"Batch mate number {i} says", max_tokens=600,
                    sampling=pb.SamplingParams(temperature=1.0, seed=i) if i % 2 else None),
            timeout=TIMEOUT,
        )
        for i in range(4)
    ]
    try:
        for call in mates:
            next(call)  # each mate is running
        load = stub.GetLoad(pb.LoadRequest(), timeout=TIMEOUT)
        assert load.requests_running + load.requests_waiting >= 4
        results: list[list[int]] = []

        def seeded_run() -> None:
            results.append(list(stub.Generate(_seeded(1234), timeout=TIMEOUT).token_ids))

        threads = [threading.Thread(target=seeded_run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [alone, alone]
    finally:
        for call in mates:
            call.cancel()
    wait_idle(stub)


def test_cancelled_stream_frees_kv_blocks(stub: pb_grpc.TandemStub) -> None:
    wait_idle(stub)
    call = stub.GenerateStream(request(text=PROMPT, max_tokens=1000), timeout=TIMEOUT)
    got = 0
    for _ in range(3):
        got += len(next(call).token_ids)
    load = stub.GetLoad(pb.LoadRequest(), timeout=TIMEOUT)
    assert load.requests_running == 1
    assert load.kv_blocks_free < load.kv_blocks_total
    call.cancel()
    with pytest.raises(grpc.RpcError) as exc:
        for m in call:
            got += len(m.token_ids)
    assert exc.value.code() == grpc.StatusCode.CANCELLED
    assert got < 1000
    load = wait_idle(stub, timeout=5.0)
    assert load.kv_blocks_free == load.kv_blocks_total == NUM_KV_BLOCKS
    assert load.kv_cache_usage == pytest.approx(0.0)
    # and the server goes on serving
    assert len(stub.Generate(request(text=PROMPT, max_tokens=3), timeout=TIMEOUT).token_ids) == 3


def test_client_deadline_frees_kv_blocks(stub: pb_grpc.TandemStub) -> None:
    wait_idle(stub)
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(request(text=PROMPT, max_tokens=1000), timeout=0.3)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(stub, timeout=5.0)


# -- the real model -----------------------------------------------------------------------------


def test_real_model_knows_the_capital_of_france(smol_dir: Path, serve: ServerFactory) -> None:
    """The embedded model, over the native API and (the same server) the published openai client."""
    cache = Path(os.environ.get("TANDEM_TEST_CACHE", default_cache_dir()))
    with serve.started("--cache-dir", str(cache), model=None, http=True) as live:
        with grpc.insecure_channel(live.address) as channel:
            real = pb_grpc.TandemStub(channel)
            info = real.GetModelInfo(pb.ModelInfoRequest(), timeout=TIMEOUT)
            assert info.model == "smollm2-135m-instruct"
            assert info.has_chat_template
            req = request(chat=[pb.ChatMessage(role="user", content="What is the capital of France?")],
                          max_tokens=64, ignore_eos=False)
            resp = real.Generate(req, timeout=TIMEOUT)
            assert "Paris" in resp.text, resp.text
            # a short answer that ends on EOS: returned as the last token id, absent from the text
            assert resp.finish_reason == pb.FINISH_REASON_STOP
            assert resp.token_ids[-1] in info.eos_token_ids
            assert resp.stop_reason == ""  # an end of sequence is no stop token of the request's
            assert "<|im_end|>" not in resp.text
            streamed = merge(stream_all(real, req))[0]
            assert streamed == resp.text
        _real_model_over_openai(live.http_port)


def _real_model_over_openai(http_port: int) -> None:
    """What the openai client reads of the embedded model: an answer the model ends (EOS) has
    finish_reason "stop" and a null stop_reason; a stream whose tokens end inside UTF-8 characters
    (emoji are several byte tokens each) sends no chunk of empty text before its last."""
    model, url = "smollm2-135m-instruct", f"http://127.0.0.1:{http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=64, temperature=0,
        )
        choice = answer.choices[0]
        assert "Paris" in choice.message.content
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] is None
        chunks = client.completions.create(
            model=model, prompt="I love pizza 🍕", max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        chunks = [c.choices[0] for c in chunks]
        assert all(c.text for c in chunks[:-1]), [c.text for c in chunks]
        ids = [t for c in chunks for t in c.model_extra["token_ids"]]
        assert len(ids) == 24 and len(chunks) < 24  # tokens waited for the rest of their character
        assert "\ufffd" not in "".join(c.text for c in chunks)
