"""Evaluation against a real `tandem serve`: over the OpenAI HTTP front, echo with prompt logprobs,
vLLM's `prompt_logprobs`, `/tokenize`, `/detokenize` and `/tokenizer_info`, and the requests
lm-evaluation-harness's `local-completions` model sends, byte for byte in shape, with its parsing of
the answers; over the native gRPC API, `prompt_logprobs`. The logprobs are checked against a
float32 transformers forward of the served model.

lm-evaluation-harness itself is not a test dependency (it brings ~560 MB of packages and indexes
~14k task files when it starts: docs/api.md, "Evaluation"); its requests are copied from
lm_eval/models/openai_completions.py (`LocalCompletionsAPI._create_payload` and `parse_logprobs`)
and lm_eval/utils.py (`RemoteTokenizer`, `check_remote_tokenizer_support`), v0.4.13.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverproc import TINY_SERVER_MODEL
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

TIMEOUT = 60.0
TOL = 1e-3  # per token, fp32 on CPU
COMPLETIONS = "/v1/completions"
CONTEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"
CONTINUATIONS = [" there was a king", " the end", "!"]


@pytest.fixture(scope="module")
def base_url(tiny_server_http: str) -> str:
    return tiny_server_http


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """The served model's weights in float32, with transformers' own attention."""
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: the model's log-distribution over each token after the first."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def call(base_url: str, method: str, path: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(urlsplit(base_url).netloc, timeout=TIMEOUT)
    conn.request(method, path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def post(base_url: str, path: str, body: dict | bytes) -> tuple[int, dict]:
    return call(base_url, "POST", path, body)


# -- lm-evaluation-harness's requests ----------------------------------------------------------


def remote_encode(base_url: str, text: str) -> list[int]:
    """lm_eval.utils.RemoteTokenizer.encode: POST /tokenize without special tokens."""
    status, answer = post(base_url, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, answer
    return answer["tokens"]


def loglikelihood_payload(tokens: list[int]) -> dict:
    """LocalCompletionsAPI._create_payload(generate=False), one request of a batch of one (the
    prompt: a list of token lists, as tokenized_requests=True sends it)."""
    return {"model": TINY_SERVER_MODEL, "prompt": [tokens], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip


def parse_logprobs(out: dict, ctxlen: int) -> tuple[float, bool]:
    """LocalCompletionsAPI.parse_logprobs for one choice."""
    choice = sorted(out["choices"], key=lambda c: c["index"])[0]
    logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs, strict=True))
    return logprobs, is_greedy


def test_lm_eval_remote_tokenizer_probe(base_url: str, tokenizer) -> None:
    """What check_remote_tokenizer_support and RemoteTokenizer read: lm-eval then needs no local
    tokenizer at all."""
    status, info = call(base_url, "GET", "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert remote_encode(base_url, "test") == tokenizer.encode("test", add_special_tokens=False)
    ids = remote_encode(base_url, CONTEXT)
    status, answer = post(base_url, "/detokenize", {"tokens": ids})
    assert status == 200 and answer == {"prompt": CONTEXT}


def test_lm_eval_loglikelihood_requests_equal_the_models_forward(base_url: str, model) -> None:
    ctx = remote_encode(base_url, CONTEXT)
    results = []
    for continuation in CONTINUATIONS:
        cont = remote_encode(base_url, continuation)
        tokens = ctx + cont
        status, out = post(base_url, COMPLETIONS, loglikelihood_payload(tokens))
        assert status == 200, out
        lp = out["choices"][0]["logprobs"]
        # the prompt's tokens, then the one generated token
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(tokens) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert out["usage"] == {**out["usage"], "prompt_tokens": len(tokens), "completion_tokens": 1}
        ref = reference(model, tokens)
        expected = [float(ref[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]
        assert lp["token_logprobs"][1 : len(tokens)] == pytest.approx(expected, abs=TOL)
        for top, dist in zip(lp["top_logprobs"][1 : len(tokens)], ref, strict=True):
            assert len(top) == 1 and list(top.values()) == pytest.approx([float(dist.max())], abs=TOL)
        logprob, is_greedy = parse_logprobs(out, len(ctx))
        want = sum(expected[len(ctx) - 1 :])
        assert logprob == pytest.approx(want, abs=TOL * len(cont))
        greedy = all(int(ref[i].argmax()) == tokens[i + 1] for i in range(len(ctx) - 1, len(tokens) - 1))
        assert is_greedy == greedy
        results.append(logprob)
    assert len(set(results)) == len(results)  # each continuation scored on its own


def test_lm_eval_generation_request(base_url: str, tokenizer) -> None:
    """LocalCompletionsAPI._create_payload(generate=True): greedy, stop sequences with the EOS."""
    ids = remote_encode(base_url, CONTEXT)
    body = {"prompt": [ids], "model": TINY_SERVER_MODEL, "max_tokens": 12, "temperature": 0,
            "stop": ["\n\n", tokenizer.eos_token], "seed": 1234}  # fmt: skip
    status, out = post(base_url, COMPLETIONS, body)
    assert status == 200, out
    text = out["choices"][0]["text"]  # LocalCompletionsAPI.parse_generations
    status, plain = post(base_url, COMPLETIONS, {"prompt": CONTEXT, "max_tokens": 12, "temperature": 0})
    assert isinstance(text, str) and 0 < out["usage"]["completion_tokens"] <= 12
    # the same greedy text as from the same tokens given as text (no special tokens are added)
    assert plain["choices"][0]["text"].startswith(text.split("\n\n")[0])


# -- echo, prompt_logprobs ------------------------------------------------------------------------


def test_echo_with_max_tokens_zero_is_the_prompt_alone(base_url: str, model, tokenizer) -> None:
    body = {"prompt": CONTEXT, "echo": True, "max_tokens": 0, "logprobs": 2}
    status, out = post(base_url, COMPLETIONS, body)
    assert status == 200, out
    choice = out["choices"][0]
    ids = tokenizer.encode(CONTEXT)
    assert choice["text"] == CONTEXT and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    ref = reference(model, ids)
    assert lp["token_logprobs"][1:] == pytest.approx([float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)],
                                                     abs=TOL)  # fmt: skip
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    # echo without logprobs: the text only; with tokens as the prompt: their decoded text
    body = {"prompt": ids, "echo": True, "max_tokens": 3, "temperature": 0}
    status, out = post(base_url, COMPLETIONS, body)
    assert status == 200 and out["choices"][0]["logprobs"] is None
    assert out["choices"][0]["text"].startswith(tokenizer.decode(ids))
    assert out["usage"]["completion_tokens"] == 3


def test_streamed_echo_starts_with_the_prompt(base_url: str) -> None:
    body = {"prompt": CONTEXT, "echo": True, "max_tokens": 4, "logprobs": 0, "stream": True, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    conn = http.client.HTTPConnection(urlsplit(base_url).netloc, timeout=TIMEOUT)
    conn.request("POST", COMPLETIONS, json.dumps(body), {"Content-Type": "application/json"})
    raw = conn.getresponse().read().split(b"\n\n")
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in raw if e and e != b"data: [DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(CONTEXT) and first["logprobs"]["token_logprobs"][0] is None
    streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    _, whole = post(base_url, COMPLETIONS, {**body, "stream": False})
    expected = whole["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed[0] is None and expected[0] is None
    assert streamed[1:] == pytest.approx(expected[1:], abs=1e-5)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_vllm_prompt_logprobs(base_url: str, model, tokenizer) -> None:
    status, out = post(base_url, COMPLETIONS, {"prompt": CONTEXT, "max_tokens": 2, "prompt_logprobs": 3})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] != CONTEXT and choice["logprobs"] is None  # no echo, no completion logprobs
    ids = tokenizer.encode(CONTEXT)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    ref = reference(model, ids)
    for pos, (entry, dist) in enumerate(zip(entries[1:], ref, strict=True), 1):
        token = entry[str(ids[pos])]
        assert token["logprob"] == pytest.approx(float(dist[ids[pos]]), abs=TOL)
        assert token["decoded_token"] == tokenizer.decode([ids[pos]])
        ranked = sorted((v for k, v in entry.items() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["logprob"] for v in ranked[-3:]] == pytest.approx(dist.topk(3).values.tolist(), abs=TOL)
        assert 3 <= len(entry) <= 4  # the top 3, and the prompt's token where it is not among them


def test_a_prompt_cached_by_others_still_gets_its_logprobs(base_url: str, model, tokenizer) -> None:
    """A prompt another request left in the prefix cache: its logprobs are computed all the same."""
    prompt = CONTEXT + " in a land far away, a dragon slept on a hoard of gold and old songs"
    for _ in range(2):
        assert post(base_url, COMPLETIONS, {"prompt": prompt, "max_tokens": 1})[0] == 200
    body = {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 0}
    status, out = post(base_url, COMPLETIONS, body)
    assert status == 200, out
    ids = tokenizer.encode(prompt)
    ref = reference(model, ids)
    got = out["choices"][0]["logprobs"]["token_logprobs"]
    assert got[1:] == pytest.approx([float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)], abs=TOL)


# -- the native API ------------------------------------------------------------------------------


def test_native_prompt_logprobs(tiny_server: str, model, tokenizer) -> None:
    ids = tokenizer.encode(CONTEXT)
    ref = reference(model, ids)
    with grpc.insecure_channel(tiny_server) as channel:
        stub = pb_grpc.TandemStub(channel)
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), stopping=pb.StoppingCriteria(max_tokens=3),
            prompt_logprobs=pb.LogprobsOptions(enabled=True, top_logprobs=2),
        )  # fmt: skip
        answer = stub.Generate(req, timeout=TIMEOUT)
        streamed = list(stub.GenerateStream(req, timeout=TIMEOUT))
        plain = stub.Generate(pb.GenerateRequest(text=CONTEXT), timeout=TIMEOUT)
        with pytest.raises(grpc.RpcError) as bad:
            req.prompt_logprobs.top_logprobs = 21
            stub.Generate(req, timeout=TIMEOUT)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not plain.prompt_logprobs
    assert [lp.token_id for lp in answer.prompt_logprobs] == ids[1:]
    for pos, lp in enumerate(answer.prompt_logprobs):
        dist = ref[pos]
        assert lp.logprob == pytest.approx(float(dist[ids[pos + 1]]), abs=TOL)
        assert lp.token == tokenizer.convert_ids_to_tokens(ids[pos + 1]) and lp.HasField("rank")
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(dist.topk(2).values.tolist(), abs=TOL)
    assert len(streamed[0].prompt_logprobs) == len(ids) - 1
    assert all(not m.prompt_logprobs for m in streamed[1:])
    assert [lp.logprob for lp in streamed[0].prompt_logprobs] == [lp.logprob for lp in answer.prompt_logprobs]


# -- /tokenize, /detokenize ---------------------------------------------------------------------


def test_tokenize_and_detokenize(base_url: str, tokenizer) -> None:
    status, out = post(base_url, "/tokenize", {"model": TINY_SERVER_MODEL, "prompt": CONTEXT})
    assert status == 200
    assert out["tokens"] == tokenizer.encode(CONTEXT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] > 0
    messages = [{"role": "user", "content": "Name three colours."}]
    status, chat = post(base_url, "/tokenize", {"messages": messages})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert status == 200 and chat["tokens"] == list(rendered.get("input_ids", rendered))
    status, back = post(base_url, "/detokenize", {"model": TINY_SERVER_MODEL, "tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.decode(out["tokens"])}
    assert post(base_url, "/tokenize", {"prompt": ""})[1]["tokens"] == tokenizer.encode("")
    assert post(base_url, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


_VALUES = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=6)
    | st.lists(st.integers(-5, 60_000), max_size=4)
    | st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]), st.text(max_size=4)), max_size=2)
)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/tokenize", "/detokenize"]),
    body=st.dictionaries(
        st.sampled_from(["model", "prompt", "messages", "tokens", "add_special_tokens",
                         "add_generation_prompt"]),  # fmt: skip
        _VALUES,
        max_size=4,
    ),
)
def test_fuzzed_tokenizer_bodies_get_a_documented_status(base_url: str, path: str, body: dict) -> None:
    status, answer = post(base_url, path, body)
    assert status in (200, 400, 404), (status, answer, body)
    if status != 200:
        assert answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
