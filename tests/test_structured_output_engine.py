"""Structured output in the engine: a constrained sequence's tokens always parse, on both step loops,
through preemption (recompute and KV offload) and prefix caching, beside unconstrained sequences
whose tokens it leaves as they were; the matcher follows its sequence token for token."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
from engine_harness import Arrival, make_core, run
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.service.contract import Request, SamplingParams, StructuredOutput
from tandem.service.engine.grammar import Grammars, tokenizer_ids
from tandem.service.engine.sampler import mask_logits
from tandem.service.engine.sequence import Sequence
from tandem.service.structured_output import canonical_schema

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ("red", "green", "blue")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    path = tiny_model_dir("llama")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _core(model, tokenizer, **kwargs):
    eos = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})
    core = make_core(model, eos=eos, **kwargs)
    core.grammars = Grammars(tokenizer, model.config.vocab_size, eos)
    return core, eos


def _arrivals(tokenizer, constrained: bool) -> list[Arrival]:
    prompt = tokenizer.encode("Describe a pet as JSON:")
    arrivals = []
    for i in range(4):  # unconstrained, seeded: their tokens must not depend on their companions
        arrivals.append(Arrival(f"free{i}", prompt + [100 + i], SamplingParams(
            temperature=1.0, seed=i, max_tokens=16, ignore_eos=True), at_step=i))
    if constrained:
        kinds = [StructuredOutput(json_schema=canonical_schema(SCHEMA)), StructuredOutput(regex=REGEX),
                 StructuredOutput(choice=CHOICES), StructuredOutput(json_object=True)]
        for i in range(8):  # any JSON object (kind 3) runs to max_tokens on a random model: few of them
            arrivals.append(Arrival(f"c{i}", prompt + [200 + i], SamplingParams(
                temperature=1.0, seed=50 + i, max_tokens=24 if i % 4 == 3 else 100,
                structured_output=kinds[i % 4]), at_step=i // 2))
    return arrivals


_ALONE: dict = {}


def _alone(model, tokenizer, loop: str):
    """The unconstrained arrivals' tokens by themselves (once per loop)."""
    if loop not in _ALONE:
        core = _core(model, tokenizer, step_loop=loop)[0]
        _ALONE[loop] = run(core, _arrivals(tokenizer, constrained=False))
    return _ALONE[loop]


def _check(rid: str, text: str, finish: str) -> None:
    kind = int(rid[1:]) % 4
    if kind == 3:  # any JSON object: a random model's strings have no bound, so it may run out of tokens
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        return
    assert finish == "stop", f"{rid}: finished by {finish}: {text!r}"
    if kind == 0:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == 1:
        assert re.fullmatch(REGEX, text), text
    elif kind == 2:
        assert text in CHOICES


@pytest.mark.parametrize("loop,num_blocks,offload,prefix_caching", [
    ("async", 256, 0, True),
    ("async", 36, 0, True),  # preemption: recompute
    ("sync", 36, 64, False),  # preemption: KV offload
])
def test_constrained_outputs_parse_and_leave_their_companions_alone(
    model_and_tokenizer, loop, num_blocks, offload, prefix_caching
):
    model, tokenizer = model_and_tokenizer
    core, _ = _core(model, tokenizer, step_loop=loop, num_blocks=num_blocks, kv_offload_blocks=offload,
                    prefix_caching=prefix_caching)
    mixed = run(core, _arrivals(tokenizer, constrained=True))
    assert not mixed.errors
    if num_blocks < 256:
        assert mixed.preemptions > 0, "the small cache was meant to preempt"
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for rid, tokens in mixed.tokens.items():
        if rid.startswith("c"):
            stopped = mixed.finish[rid] == "stop"
            assert not stopped or tokens[-1] == eos, f"{rid}: a grammar's end is the model's EOS"
            _check(rid, tokenizer.decode(tokens[:-1] if stopped else tokens), mixed.finish[rid])
    alone = _alone(model, tokenizer, loop)
    for rid, tokens in alone.tokens.items():
        assert mixed.tokens[rid] == tokens, f"{rid} changed beside constrained requests"


def test_the_matcher_follows_the_sequence_and_grammars_are_compiled_once(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    core, _ = _core(model, tokenizer, step_loop="async")
    constraint = StructuredOutput(json_schema=canonical_schema(SCHEMA))
    arrivals = [Arrival(f"c{i}", tokenizer.encode("x") + [i], SamplingParams(
        temperature=1.0, seed=i, max_tokens=100, structured_output=constraint)) for i in range(3)]
    for a in arrivals:
        core.add(Request(a.request_id, a.prompt_ids, a.params))
    # the first, on the idle engine, scheduled while it compiles; the others wait for that compile
    assert len(core.scheduler.waiting) == 1 and core.stats().waiting == 3
    seqs: list[Sequence] = []
    while core.has_work:
        core.run_once()
        seqs += [s for s in core.scheduler.running if s not in seqs]
        for seq in seqs:  # accepted exactly the tokens it appended, at every step
            assert seq.grammar.accepted == seq.num_output
    assert len(seqs) == 3
    assert core.grammars.compiled == 1 and core.grammars.hits == 2


def test_a_grammar_compiling_holds_up_only_its_own_request(model_and_tokenizer, monkeypatch):
    """A first-time constraint compiles on the compile thread: its request waits outside the queue
    while another request steps on; then it runs to a parsing answer. One the tokenizer refuses
    fails alone with INVALID_ARGUMENT; one aborted while it waits is gone."""
    import threading

    from tandem.service.contract import ErrorKind

    model, tokenizer = model_and_tokenizer
    core, eos = _core(model, tokenizer, step_loop="async")
    release = threading.Event()
    build = core.grammars._build

    def slow_build(constraint):  # noqa: ANN001, ANN202
        assert release.wait(30), "the compile thread was never released"
        if constraint.regex == "(":
            raise ValueError("unbalanced parenthesis")
        return build(constraint)

    monkeypatch.setattr(core.grammars, "_build", slow_build)
    prompt = tokenizer.encode("Describe a pet as JSON:")
    core.add(Request("free", prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
    core.add(Request("json", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=100,
                                                    structured_output=StructuredOutput(regex=REGEX))))
    core.add(Request("bad", prompt, SamplingParams(structured_output=StructuredOutput(regex="("))))
    core.add(Request("gone", prompt, SamplingParams(structured_output=StructuredOutput(choice=CHOICES))))
    assert core.abort("gone")
    tokens: dict[str, list[int]] = {}
    failed = {}
    while "free" not in tokens or len(tokens["free"]) < 6:  # the free request runs to its end
        for out in core.run_once().values():
            for rid, token in zip(out.request_ids, out.tokens, strict=True):
                tokens.setdefault(rid, []).append(token)
    assert set(tokens) == {"free"}, "a compiling request stepped"
    release.set()
    while core.has_work:
        for out in core.run_once().values():
            for rid, token in zip(out.request_ids, out.tokens, strict=True):
                tokens.setdefault(rid, []).append(token)
            failed |= {rid: (kind, why) for rid, kind, why in out.failed}
    assert set(tokens) == {"free", "json"} and set(failed) == {"bad"}
    assert failed["bad"][0] == ErrorKind.INVALID_ARGUMENT and "cannot be compiled" in failed["bad"][1]
    text = tokenizer.decode(tokens["json"][:-1] if tokens["json"][-1] in eos else tokens["json"])
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_on_an_idle_engine_a_first_time_grammar_compiles_while_its_prompt_is_prefilled(
        model_and_tokenizer, monkeypatch, loop):
    """Nothing else to run: a request whose grammar is new is scheduled at once, its prompt's step
    launched before the compile ends, and its first token sampled under the compiled grammar (the
    answer parses). One whose grammar the model's tokenizer refuses fails alone with
    INVALID_ARGUMENT, and the engine serves the next request."""
    from tandem.service.contract import ErrorKind

    model, tokenizer = model_and_tokenizer
    core, eos = _core(model, tokenizer, step_loop=loop)
    build = core.grammars._build
    compiled_at: dict[str, float] = {}

    def slow_build(constraint):  # noqa: ANN001, ANN202
        time.sleep(0.3)  # the prompt's step is launched meanwhile
        compiled_at[constraint.kind] = time.time()
        if constraint.regex == "(":
            raise ValueError("unbalanced parenthesis")
        return build(constraint)

    monkeypatch.setattr(core.grammars, "_build", slow_build)
    prompt = tokenizer.encode("Describe a pet as JSON:")

    def serve(request_id: str, constraint: StructuredOutput) -> tuple[list[int], float | None, tuple | None]:
        core.add(Request(request_id, prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=100,
                                                            structured_output=constraint)))
        assert core.scheduler.waiting and core.stats().waiting == 1, "scheduled at once"
        tokens, scheduled, failure = [], None, None
        while core.has_work:
            for out in core.run_once().values():
                for _row, at, _cached in out.started:
                    scheduled = at
                tokens += out.tokens
                failure = next(((kind, why) for rid, kind, why in out.failed if rid == request_id), failure)
        return tokens, scheduled, failure

    tokens, scheduled, failure = serve("re", StructuredOutput(regex=REGEX))
    assert failure is None and scheduled < compiled_at["regex"]
    text = tokenizer.decode(tokens[:-1] if tokens[-1] in eos else tokens)
    assert re.fullmatch(REGEX, text), text
    compiled_at.clear()
    tokens, _, failure = serve("bad", StructuredOutput(regex="("))
    assert tokens == [] and failure[0] == ErrorKind.INVALID_ARGUMENT and "cannot be compiled" in failure[1]
    assert not core.has_work
    tokens, _, failure = serve("json", StructuredOutput(json_schema=canonical_schema(SCHEMA)))
    assert failure is None
    jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1] if tokens[-1] in eos else tokens)), SCHEMA)


@pytest.mark.parametrize("padding", [0, 45, 40_000])
def test_a_padded_vocabulary_masks_as_the_tokenizers_own_and_allows_no_padding_id(model_and_tokenizer,
                                                                                  padding):
    """A model's vocabulary padded past the tokenizer's ids: xgrammar sees the tokenizer's ids only
    (it scans the ids it counts as special on every token it accepts), a constrained row allows the
    tokens it would over the tokenizer's own vocabulary and no padding id, an unconstrained row every
    token; and the matcher accepts as it would."""
    model, tokenizer = model_and_tokenizer
    ids = tokenizer_ids(tokenizer)
    eos = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})
    exact, padded = Grammars(tokenizer, ids, eos), Grammars(tokenizer, ids + padding, eos)
    assert padded.info.vocab_size == ids
    assert len(padded.info.special_token_ids) == len(exact.info.special_token_ids)
    constraint = StructuredOutput(json_schema=canonical_schema(SCHEMA))
    params = SamplingParams(max_tokens=64, structured_output=constraint)
    prefix = tokenizer.encode('{"name": "Rex", "kind": "', add_special_tokens=False)

    def rows(grammars: Grammars) -> torch.Tensor:
        seqs = []
        for i, constrained in enumerate([True, False, True]):
            seq = Sequence(request=Request(f"r{i}", [1, 2], params if constrained else SamplingParams()),
                           token_ids=[1, 2], prompt_len=2, seed=i, max_total_len=128)
            if constrained:
                seq.grammar = grammars.state_for(seq)
            seqs.append(seq)
        for token in prefix:  # the third row's matcher inside an enum's string
            assert not seqs[2].grammar.accept(token)  # accepted, not the end
        assert seqs[2].grammar.accepted == len(prefix)
        def allowed(mask: torch.Tensor) -> torch.Tensor:
            bits = ((mask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(len(mask), -1)
            return bits[:, : grammars.vocab_size].bool()

        every = allowed(grammars.fill(seqs, slot=0).clone())
        constrained_only = allowed(grammars.fill([seqs[0], seqs[2]], slot=1))  # every row constrained
        assert torch.equal(constrained_only, every[[0, 2]])
        return every

    want, got = rows(exact), rows(padded)
    assert got.shape[1] == ids + padding
    assert torch.equal(got[:, :ids], want) and got[1].all()
    assert not got[0, ids:].any() and not got[2, ids:].any()
    assert got[0].any() and got[2].any() and not torch.equal(got[0], got[2])  # two states, each some tokens


def test_masked_logits_keep_allowed_tokens_and_drop_the_rest():
    logits = torch.arange(70, dtype=torch.float32).repeat(2, 1)
    mask = torch.zeros((2, 3), dtype=torch.int32)
    mask[0, 0] = 1 << 5  # token 5
    mask[0, 2] = 1 << 3  # token 67
    mask[1] = -1  # every token (bit 31 included: the sign bit)
    out = mask_logits(logits, mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5, 67]
    assert out[0, 67] == 67 and torch.equal(out[1], logits[1])


def test_a_length_bounded_json_string_refuses_raw_control_characters(model_and_tokenizer):
    # JSON strings carry control characters escaped only; xgrammar's class for bounded strings lets
    # them through raw (structured_output._json swaps it)
    _, tokenizer = model_and_tokenizer
    core, _ = _core(*model_and_tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]}
    bounded = StructuredOutput(json_schema=canonical_schema(schema))
    for constraint in (bounded, StructuredOutput(json_object=True)):
        seq = Sequence(Request("r", [1], SamplingParams(structured_output=constraint)), [1], 1, 0, 100,
                       frozenset({2}))
        seq.grammar = core.grammars.state_for(seq)
        for token in tokenizer.encode('{"a": "x', add_special_tokens=False):
            assert not seq.grammar.accept(token)
        mask = core.grammars.fill([seq], 0)[0]
        allowed = {t for t in range(len(tokenizer)) if (mask[t // 32] >> (t % 32)) & 1}
        assert tokenizer.convert_tokens_to_ids("Ğ") not in allowed  # byte 0x1e
        assert all(not any(ord(c) < 0x20 for c in tokenizer.decode([t])) for t in allowed)
