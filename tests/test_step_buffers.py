"""A slot's staging: what a step's host batch becomes in the device buffers, padding rows included."""

from __future__ import annotations

import torch

from tandem.service.engine.batch import build_host_batch
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.sampling_params import SamplingParams
from tandem.service.engine.scheduler import Scheduler
from tandem.service.engine.sequence import Sequence
from tandem.service.engine.step_buffers import StepBuffers


def _decode_step() -> tuple[list, dict[int, int]]:
    s = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    for rid, n, temp in (("a", 6, 0.0), ("b", 3, 0.7), ("c", 9, 0.0)):
        s.add(Sequence(rid, list(range(10, 10 + n)), n, SamplingParams(max_tokens=8, temperature=temp),
                       seed=ord(rid), max_total_len=100, stop_ids=frozenset()))
    first = s.schedule()  # prefills; their tokens are in flight when the next step is scheduled
    rows = {id(c.seq): i for i, c in enumerate(first.chunks)}
    return s.schedule().chunks, rows


def test_decode_step_padded_to_a_graph_bucket():
    chunks, rows = _decode_step()
    batch = build_host_batch(chunks, 4, prev_rows=rows)
    buf = StepBuffers(max_tokens=16, max_seqs=8, max_blocks=8, device=torch.device("cpu"),
                      scratch_block=32, block_size=4)
    buf.dev["carry"].fill_(123)  # stale values from an earlier step must not leak through
    dev = buf.upload(batch, pad_to=4)
    d = buf.dev
    assert dev.input_ids.tolist() == [0, 0, 0]  # placeholders: every input is still on the device
    assert d["carry"][:4].tolist() == [0, 1, 2, -1]
    assert d["positions"][:3].tolist() == [6, 3, 9]
    assert d["ctx_lens"][:4].tolist() == [7, 4, 10, 1]  # padding row: one token of context
    assert d["slot_mapping"][3].item() == 32 * 4  # padding row writes the scratch block
    assert d["block_table"][3, 0].item() == 32
    assert d["temperature"][:4].tolist() == [0.0, 0.699999988079071, 0.0, 0.0]  # padding is greedy
    for i, c in enumerate(chunks):  # each decode row reads its own blocks
        assert d["block_table"][i, : len(c.seq.block_ids)].tolist() == c.seq.block_ids
    assert dev.block_table.shape == (3, batch.decode_block_table.shape[1])


def test_mixed_step_keeps_exact_sizes():
    s = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(Sequence("a", list(range(5)), 5, SamplingParams(max_tokens=4), seed=1, max_total_len=100,
                   stop_ids=frozenset()))
    batch = build_host_batch(s.schedule().chunks, 4)
    buf = StepBuffers(16, 8, 8, torch.device("cpu"), scratch_block=32, block_size=4)
    dev = buf.upload(batch)
    assert dev.input_ids.tolist() == list(range(5)) and dev.carry.tolist() == [-1] * 5
    assert dev.logits_indices.tolist() == [4] and dev.block_table.shape[0] == 0


def test_staged_tensors_keep_their_buffers_and_grow_when_a_step_needs_more():
    """`stage` (the packed prompt chunks' indexes): each name has its own buffers, reused at the
    same address while a step's tensor fits, grown for a larger one; shapes and values survive."""
    buf = StepBuffers(max_tokens=16, max_seqs=8, max_blocks=8, device=torch.device("cpu"),
                      scratch_block=32, block_size=4)
    first = buf.stage("index", torch.arange(10, dtype=torch.int64))
    offsets = buf.stage("offsets", torch.tensor([[0, 3, 10], [0, 5, 20]], dtype=torch.int32))
    assert first.tolist() == list(range(10)) and offsets.dtype == torch.int32
    assert offsets.tolist() == [[0, 3, 10], [0, 5, 20]]  # its own buffer: the index is untouched
    again = buf.stage("index", torch.arange(100, 110, dtype=torch.int64))
    assert again.data_ptr() == first.data_ptr() and again.tolist() == list(range(100, 110))
    big = buf.stage("index", torch.arange(5000, dtype=torch.int64))
    assert big.tolist() == list(range(5000))
    small = buf.stage("index", torch.tensor([7, 8], dtype=torch.int64))
    assert small.data_ptr() == big.data_ptr() and small.tolist() == [7, 8]
