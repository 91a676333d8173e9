"""The asynchronous loop's host side: scheduling ahead, carry-over indices, dropped extra tokens."""

from __future__ import annotations

import torch

from tandem.service.contract import FinishReason, Request, SamplingParams
from tandem.service.engine.batch import carry_over
from tandem.service.engine.batch_builder import StepInputsBuilder
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.scheduler import Scheduler
from tandem.service.engine.sequence import Sequence


def seq(rid: str, prompt_len: int, max_tokens: int = 8, stop: frozenset[int] = frozenset()) -> Sequence:
    return Sequence(Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens)),
                    list(range(10, 10 + prompt_len)), prompt_len, seed=0, max_total_len=1000, stop_ids=stop)


def test_scheduling_ahead_carries_the_inflight_token():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq("a", 5), seq("b", 3)
    s.add(a)
    s.add(b)
    step1 = s.schedule()  # both prefill, both sample a token that is now in flight
    assert [c.samples for c in step1.chunks] == [True, True] and a.num_inflight == 1
    step2 = s.schedule()  # scheduled before step 1's tokens are known
    assert [(c.seq.request_id, c.start, c.num_tokens, c.carried) for c in step2.chunks] == [
        ("a", 5, 1, True), ("b", 3, 1, True)]
    rows = {id(c.seq): i for i, c in enumerate(step1.chunks)}
    batch = StepInputsBuilder(4).build(step2.chunks, rows)
    assert batch.input_ids.tolist() == [0, 0]  # placeholders on the host
    assert batch.carry.tolist() == [0, 1]  # taken from step 1's sampled rows on the device
    assert batch.positions.tolist() == [5, 3]
    assert batch.sampling.steps.tolist() == [1, 1]  # the second output token of each
    merged = carry_over(batch.input_ids, batch.carry, torch.tensor([77, 88]))
    assert merged.tolist() == [77, 88]


def test_a_sequence_that_stops_in_step_n_drops_its_token_from_step_n_plus_1():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = seq("a", 4, stop=frozenset({99}))
    s.add(a)
    step1 = s.schedule()
    step2 = s.schedule()  # launched before step 1's result
    assert s.finish_step(step1, {0: 99}) == [0]  # step 1 sampled the stop token: a took it
    assert a.finish_reason is FinishReason.STOP and s.blocks.num_free == 64
    assert s.finish_step(step2, {0: 5}) == []  # the extra token of step 2 is dropped
    assert a.token_ids[-1] == 99 and a.num_output == 1


def test_no_step_is_scheduled_past_max_tokens():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = seq("a", 4, max_tokens=1)
    s.add(a)
    s.schedule()  # prefill samples the only token allowed
    assert s.schedule().chunks == []  # nothing more: its in-flight token already reaches max_tokens


def test_a_preempted_sequence_waits_for_its_inflight_token_before_readmission():
    s = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    old, new = seq("old", 7, max_tokens=20), seq("new", 7, max_tokens=20)
    s.add(old)
    s.add(new)
    step1 = s.schedule()  # 2 blocks each, both sample position 7
    step2 = s.schedule()  # decode at position 7 fits in the second block for both
    s.finish_step(step1, {0: 1, 1: 2})
    step3 = s.schedule()  # position 8 needs a third block each: 'new' is preempted, its token in flight
    assert [p.request_id for p in step3.preempted] == ["new"] and new.num_inflight == 1
    assert s.schedule().chunks[-1].seq is old  # 'new' is not readmitted while its token is in flight
    s.finish_step(step2, {0: 3, 1: 4})
    assert new.num_inflight == 0 and new.token_ids[-1] == 4
