"""One request's failure fails that request only: its batch-mates finish with the tokens they would
have had (recomputed alone after the failed step), and a device failure stops the engine.

Failures are injected into a real engine's runner (a tiny random llama on CPU) for one request's
steps, at launch or at the wait for the step's tokens, on both step loops.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from engine_harness import Arrival, hf_greedy, make_core, run
from transformers import AutoModelForCausalLM

from tandem.service.contract import SamplingParams
from tandem.service.engine.engine_core import MAX_FAILED_STEPS, EngineCore, EngineFailure
from tandem.service.engine.scheduler import ScheduledChunk, SchedulerOutput

POISONED = "r3"


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()


def _arrivals(vocab: int, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    lengths, steps = [9, 40, 3, 17, 25, 6, 12], [0, 0, 0, 1, 1, 2, 6]
    return [
        Arrival(f"r{i}", [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=16), at)
        for i, (n, at) in enumerate(zip(lengths, steps, strict=True))
    ]


def _inject(
    core: EngineCore, where: str, fails: Callable[[list[ScheduledChunk]], bool], error: str
) -> list[int]:
    """Make the runner's `where` ("launch" or "wait") raise for steps `fails` picks; their sizes."""
    runner, failed_sizes, doomed = core.runner, [], set()
    launch, wait = runner.launch, runner.wait

    def launching(out: SchedulerOutput, prev: object, scheduled: float, constrained: bool = False) -> object:
        if fails(out.chunks):
            failed_sizes.append(len(out.chunks))
            if where == "launch":
                raise RuntimeError(error)
            step = launch(out, prev, scheduled, constrained)
            doomed.add(id(step))
            return step
        return launch(out, prev, scheduled, constrained)

    def waiting(step: object) -> object:
        result = wait(step)
        if id(step) in doomed:
            doomed.discard(id(step))
            raise RuntimeError(error)
        return result

    runner.launch, runner.wait = launching, waiting
    return failed_sizes


def _poisoned(chunks: list[ScheduledChunk]) -> bool:
    return any(c.seq.request_id == POISONED for c in chunks)


_REFERENCE: dict[tuple[int, ...], list[int]] = {}  # prompt -> transformers' greedy tokens (16 new)


def _expect_greedy(model: torch.nn.Module, arrivals: list[Arrival], tokens: dict, skip: set[str]) -> None:
    for a in arrivals:
        if a.request_id in skip:
            continue
        key = tuple(a.prompt_ids)
        if key not in _REFERENCE:
            _REFERENCE[key] = hf_greedy(model, a.prompt_ids, a.params.max_tokens, None)
        assert tokens[a.request_id] == _REFERENCE[key], a.request_id


@pytest.mark.parametrize("where", ["launch", "wait"])
@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_failing_request_fails_alone(model: torch.nn.Module, loop: str, where: str) -> None:
    arrivals = _arrivals(model.config.vocab_size)
    core = make_core(model, max_num_batched_tokens=48, step_loop=loop)
    failed_sizes = _inject(core, where, _poisoned, "injected failure in r3's work")
    result = run(core, arrivals)  # also checks that every KV block is free at the end
    assert max(failed_sizes) >= 4, "the poisoned request was meant to fail inside a batch"
    assert failed_sizes[-1] == 1, "the culprit is pinned by a step of its own"
    assert set(result.errors) == {POISONED} and "injected failure" in result.errors[POISONED]
    assert POISONED not in result.finish
    _expect_greedy(model, arrivals, result.tokens, skip={POISONED})


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_transient_step_failure_fails_nobody(model: torch.nn.Module, loop: str) -> None:
    arrivals = _arrivals(model.config.vocab_size, seed=1)
    core = make_core(model, max_num_batched_tokens=48, step_loop=loop)
    calls = {"n": 0}

    def once_mid_decode(chunks: list[ScheduledChunk]) -> bool:
        calls["n"] += 1
        return calls["n"] == 6

    _inject(core, "wait", once_mid_decode, "a passing glitch")
    result = run(core, arrivals)
    assert result.errors == {}
    _expect_greedy(model, arrivals, result.tokens, skip=set())


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_quarantined_requests_start_after_their_cached_prefix(model: torch.nn.Module, loop: str) -> None:
    """With prefix caching, a quarantined request's blocks stay cached when freed: its lone step
    recomputes only past them (its K/V from steps that came back), and it gets the same tokens."""
    arrivals = _arrivals(model.config.vocab_size)
    core = make_core(model, block_size=4, max_num_batched_tokens=48, step_loop=loop, prefix_caching=True)
    lone: list[tuple[str, int]] = []  # (request, first position) of each step run alone after a failure

    def poisoned(chunks: list[ScheduledChunk]) -> bool:
        if failed_sizes and len(chunks) == 1:
            lone.append((chunks[0].seq.request_id, chunks[0].start))
        return _poisoned(chunks)

    failed_sizes = _inject(core, "launch", poisoned, "injected failure in r3's work")
    result = run(core, arrivals)
    assert set(result.errors) == {POISONED} and max(failed_sizes) >= 4
    first = {}  # each request's first lone step: from its cached prefix, whole blocks of it
    for rid, start in lone:
        first.setdefault(rid, start)
    assert all(start % 4 == 0 for start in first.values()) and any(first.values()), lone
    _expect_greedy(model, arrivals, result.tokens, skip={POISONED})


def test_a_failure_only_in_company_ends(model: torch.nn.Module) -> None:
    """A request that fails only when batched (never alone) is failed after MAX_FAILED_STEPS; the
    engine never loops on it, and requests that arrive after it are served."""
    arrivals = _arrivals(model.config.vocab_size, seed=2)
    late = Arrival("late", arrivals[0].prompt_ids, SamplingParams(max_tokens=16), at_step=400)
    core = make_core(model, max_num_batched_tokens=48, step_loop="sync")
    failed_sizes = _inject(core, "launch", lambda c: _poisoned(c) and len(c) > 1, "fails in a batch")
    result = run(core, [*arrivals, late])
    assert POISONED in result.errors and len(failed_sizes) >= MAX_FAILED_STEPS
    assert "late" not in result.errors
    _expect_greedy(model, [*arrivals, late], result.tokens, skip=set(result.errors))


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_device_failure_stops_the_engine(model: torch.nn.Module, loop: str) -> None:
    core = make_core(model, max_num_batched_tokens=48, step_loop=loop)
    _inject(core, "wait", _poisoned, "CUDA error: an illegal memory access was encountered")
    with pytest.raises(EngineFailure, match="illegal memory access"):
        run(core, _arrivals(model.config.vocab_size))
