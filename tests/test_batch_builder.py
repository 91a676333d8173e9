"""A steady decode step's inputs, derived from the step before, are the inputs built row by row."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.batch import StepInputs
from tandem.service.engine.batch_builder import StepInputsBuilder
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.scheduler import Scheduler
from tandem.service.engine.sequence import Sequence


def _same(a: StepInputs, b: StepInputs) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "decode_block_table",
                 "decode_ctx_lens", "carry"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.sample_chunks == b.sample_chunks and a.decode_token_idx == b.decode_token_idx
    assert a.prefills == b.prefills
    sa, sb = a.sampling, b.sampling
    for name in ("temperature", "top_p", "top_k", "seeds", "steps"):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    flags = ("all_greedy", "needs_filter", "num_logprobs")
    assert [getattr(sa, f) for f in flags] == [getattr(sb, f) for f in flags]


def _loop(s: Scheduler, builder: StepInputsBuilder, pending: list[Sequence], rng: random.Random,
          block_size: int, steps: int = 400) -> int:
    """The asynchronous loop's host side over `pending` arrivals: each step's batch from the builder
    checked against the batch built whole; returns how many steps were derived."""
    derived = 0
    original = builder._derived

    def counted(*args: object) -> StepInputs | None:
        nonlocal derived
        batch = original(*args)
        derived += batch is not None
        return batch

    builder._derived = counted
    inflight = None  # (scheduler output, rows) of the step launched before
    for _ in range(steps):
        while pending and rng.random() < 0.3:
            s.add(pending.pop())
        out = s.schedule()
        rows = None
        if out.chunks:
            prev_rows = inflight[1] if inflight else None
            batch = builder.build(out.chunks, prev_rows)
            _same(batch, StepInputsBuilder(block_size).build(out.chunks, prev_rows))  # a new one: rows
            rows = {id(out.chunks[ci].seq): row for row, ci in enumerate(batch.sample_chunks)}
        if inflight is not None:  # the step before finishes: its tokens arrive
            done = inflight[0]
            s.finish_step(done, {i: rng.randrange(50) for i, c in enumerate(done.chunks) if c.samples})
        inflight = (out, rows) if out.chunks else None
        if not (pending or s.has_work or inflight):
            break
    return derived


def _requests(rng: random.Random, count: int, max_tokens: int, max_len: int) -> list[Sequence]:
    out = []
    for i in range(count):
        prompt = [rng.randrange(49) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, max_tokens))
        out.append(Sequence(Request(f"r{i}", prompt, params), prompt, len(prompt), seed=i,
                            max_total_len=max_len, stop_ids=frozenset({49})))
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([4, 16]), st.sampled_from([24, 64, 400]))
def test_every_step_of_the_asynchronous_loop_is_the_batch_built_whole(seed, block_size, num_blocks):
    """Random workloads (arrivals, lengths, sampling settings, stop tokens, preemption in a small
    cache): each batch the builder makes, derived or built, are those built row by row."""
    rng = random.Random(seed)
    s = Scheduler(BlockManager(num_blocks, block_size, prefix_caching=rng.random() < 0.5), 16, 64)
    pending = _requests(rng, rng.randint(1, 24), 60, min(200, num_blocks * block_size))
    _loop(s, StepInputsBuilder(block_size), pending, rng, block_size)


def test_a_steady_decode_is_derived_step_after_step():
    """Eight sequences decoding together, crossing block boundaries: after the first steady step,
    every step is derived from the one before (and is the batch built whole); an arrival breaks
    the run and the next steady step is built whole again."""
    rng = random.Random(3)
    s = Scheduler(BlockManager(400, 4), 16, 64)
    for x in _requests(rng, 8, 1, 400):
        x.request.params, x.stop_ids = SamplingParams(max_tokens=100), frozenset()
        s.add(x)
    builder = StepInputsBuilder(4)
    derived = _loop(s, builder, [], rng, 4, steps=60)
    assert derived >= 50  # prefills, then the first steady step built whole, then derived ones
