"""A slot's staging: what a step's host batch becomes in the device buffers, padding rows included."""

from __future__ import annotations

from array import array

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.batch import build_attention_metadata
from tandem.service.engine.batch_builder import StepInputsBuilder
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.ops.kv_cache import CacheShape, KVCache
from tandem.service.engine.scheduler import ScheduledChunk, Scheduler
from tandem.service.engine.sequence import Sequence
from tandem.service.engine.step_buffers import StepBuffers


def _decode_step() -> tuple[list, dict[int, int]]:
    s = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    for rid, n, temp in (("a", 6, 0.0), ("b", 3, 0.7), ("c", 9, 0.0)):
        s.add(Sequence(Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=8, temperature=temp)),
                       list(range(10, 10 + n)), n, seed=ord(rid), max_total_len=100, stop_ids=frozenset()))
    first = s.schedule()  # prefills; their tokens are in flight when the next step is scheduled
    rows = {id(c.seq): i for i, c in enumerate(first.chunks)}
    return s.schedule().chunks, rows


def test_decode_step_padded_to_a_graph_bucket():
    chunks, rows = _decode_step()
    batch = StepInputsBuilder(4).build(chunks, rows)
    buf = StepBuffers(max_num_batched_tokens=16, max_num_seqs=8, max_blocks=8, device=torch.device("cpu"),
                      scratch_block=32, block_size=4)
    buf.dev["carry"].fill_(123)  # stale values from an earlier step must not leak through
    dev = buf.upload(batch, pad_to=4)
    d = buf.dev
    assert dev.input_ids.tolist() == [0, 0, 0]  # placeholders: every input is still on the device
    assert d["carry"][:4].tolist() == [0, 1, 2, -1]
    assert d["positions"][:3].tolist() == [6, 3, 9]
    assert d["decode_ctx_lens"][:4].tolist() == [7, 4, 10, 1]  # padding row: one token of context
    assert d["slot_mapping"][3].item() == 32 * 4  # padding row writes the scratch block
    assert d["decode_block_table"][3, 0].item() == 32
    assert d["temperature"][:4].tolist() == [0.0, 0.699999988079071, 0.0, 0.0]  # padding is greedy
    assert d["logits_indices"][:4].tolist() == d["decode_token_idx"][:4].tolist() == [0, 1, 2, 3]  # own rows
    for i, c in enumerate(chunks):  # each decode row reads its own blocks
        assert d["decode_block_table"][i, : len(c.seq.block_ids)].tolist() == list(c.seq.block_ids)
    assert dev.decode_block_table.shape == (3, batch.decode_block_table.shape[1])


def test_mixed_step_keeps_exact_sizes():
    s = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(Sequence(Request("a", list(range(5)), SamplingParams(max_tokens=4)), list(range(5)), 5, seed=1,
                   max_total_len=100, stop_ids=frozenset()))
    batch = StepInputsBuilder(4).build(s.schedule().chunks)
    buf = StepBuffers(16, 8, 8, torch.device("cpu"), scratch_block=32, block_size=4)
    dev = buf.upload(batch)
    assert dev.input_ids.tolist() == list(range(5)) and dev.carry.tolist() == [-1] * 5
    assert dev.logits_indices.tolist() == [4] and dev.decode_block_table.shape[0] == 0
    keep = buf.padded_logits_indices(1, 2)  # the compiled prefill's two rows, in the slot's own buffer
    assert keep.tolist() == [4, 0] and keep.data_ptr() == dev.logits_indices.data_ptr()


def test_capture_starts_every_device_row_as_a_padding_row():
    """Before graph capture (which runs whole buckets before any step has uploaded), every device
    row touches only the scratch block: its cache slot, a one-token context in it, no carry."""
    buf = StepBuffers(max_num_batched_tokens=16, max_num_seqs=8, max_blocks=8, device=torch.device("cpu"),
                      scratch_block=32, block_size=4)
    for t in buf.dev.values():
        t.fill_(5)  # whatever was there
    buf.pad_device_rows()
    d = buf.dev
    assert d["slot_mapping"].tolist() == [32 * 4] * 16 and d["carry"].tolist() == [-1] * 16
    assert d["decode_block_table"][:, 0].tolist() == [32] * 8 and d["decode_ctx_lens"].tolist() == [1] * 8
    assert d["logits_indices"].tolist() == d["decode_token_idx"].tolist() == list(range(8))
    assert d["temperature"].tolist() == [0.0] * 8 and d["top_p"].tolist() == [1.0] * 8


def test_staged_tensors_keep_their_buffers_and_grow_when_a_step_needs_more():
    """`stage` (the packed prompt chunks' indexes): each name has its own buffers, reused at the
    same address while a step's tensor fits, grown for a larger one; shapes and values survive."""
    buf = StepBuffers(max_num_batched_tokens=16, max_num_seqs=8, max_blocks=8, device=torch.device("cpu"),
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


@st.composite
def _steps(draw: st.DrawFn) -> tuple[list[ScheduledChunk], dict[int, int], int]:
    """A step of decode rows and prompt chunks in any order: chunks that start and end anywhere in
    a block, carried inputs, sequences whose blocks are scattered over the cache."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    free = list(range(12 * 113))  # enough for 12 chunks of block size 1
    draw(st.randoms()).shuffle(free)
    chunks, rows = [], {}
    for i in range(draw(st.integers(1, 12))):
        start = draw(st.integers(0, 80))
        n = draw(st.sampled_from([1, 1, 2, 7, 16, 33]))
        carried = draw(st.booleans())
        known = start + n - carried  # the carried input is not on the host yet
        params = SamplingParams(temperature=draw(st.sampled_from([0.0, 0.5])))
        seq = Sequence(Request(f"s{i}", [1000 * i], params), list(range(1000 * i, 1000 * i + known)), 1,
                       seed=i, max_total_len=1000)
        seq.block_ids = array("i", [free.pop() for _ in range(-(-(start + n) // block_size))])
        rows[id(seq)] = draw(st.integers(0, 255))
        chunks.append(ScheduledChunk(seq, start, n, samples=draw(st.booleans()), carried=carried))
    return chunks, rows, block_size


@settings(max_examples=200, deadline=None)
@given(_steps())
def test_host_batch_is_each_tokens_definition_packed(step):
    """The inputs built row by row against their definition, token by token: each chunk's inputs (a carried
    one's placeholder and previous-step row), positions and cache slots (block of the position,
    offset in it), in chunk order; decode rows' block tables (zero past their own blocks) and
    contexts; prompt chunks' segments; the sampled rows; and the CUDA path's packed prompt chunks
    (each chunk's query rows, the cache slots of its whole context, their offsets)."""
    chunks, rows, bs = step
    batch = StepInputsBuilder(bs).build(chunks, rows)
    ids, pos, slots, carry, table, lens, segments, logits = [], [], [], [], [], [], [], []
    for c in chunks:
        q = len(ids)
        for p in range(c.start, c.start + c.num_tokens):
            last_carried = c.carried and p == c.start + c.num_tokens - 1
            ids.append(0 if last_carried else c.seq.token_ids[p])
            carry.append(rows[id(c.seq)] if last_carried else -1)
            pos.append(p)
            slots.append(c.seq.block_ids[p // bs] * bs + p % bs)
        if c.num_tokens == 1:
            table.append(list(c.seq.block_ids))
            lens.append(c.start + 1)
        else:
            blocks = None if c.start == 0 else list(c.seq.block_ids)
            segments.append((q, c.num_tokens, c.start + c.num_tokens, blocks))
        if c.samples:
            logits.append(len(ids) - 1)
    assert batch.input_ids.tolist() == ids and batch.positions.tolist() == pos
    assert batch.slot_mapping.tolist() == slots
    assert (batch.carry.tolist() if batch.carry is not None else [-1] * len(ids)) == carry
    assert batch.logits_indices.tolist() == logits
    assert [(q, n, ctx, None if b is None else list(b)) for q, n, ctx, b in batch.prefills] == segments
    if table:
        width = max(map(len, table))
        assert batch.decode_block_table.tolist() == [t + [0] * (width - len(t)) for t in table]
        assert batch.decode_ctx_lens.tolist() == lens
    else:
        assert batch.decode_block_table is None
    if segments:  # the packed prompt chunks of the CUDA path (one flash-attention call), built here
        cache = KVCache(CacheShape(1, 1, 2), 12 * 113, bs, torch.float32, torch.device("cpu"))
        buf = StepBuffers(len(ids), len(chunks), 113, torch.device("cpu"), cache.scratch_block, bs)
        meta = build_attention_metadata(batch, buf.upload(batch), cache, varlen=buf.stage)
        packed = meta.varlen
        q_rows = [q + i for q, n, _, _ in segments for i in range(n)]
        context = [  # a fresh prompt's context is its own new tokens; a later chunk's, its blocks'
            slots[q + i] if blocks is None else blocks[i // bs] * bs + i % bs
            for q, n, ctx, blocks in segments for i in range(n if blocks is None else ctx)
        ]
        assert packed.q_index.tolist() == q_rows and packed.kv_slots.tolist() == context
        q_lens = [n for _, n, _, _ in segments]
        k_lens = [n if blocks is None else ctx for _, n, ctx, blocks in segments]
        assert packed.cu_q.tolist() == [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
        assert packed.cu_k.tolist() == [sum(k_lens[:i]) for i in range(len(k_lens) + 1)]
        assert (packed.max_q, packed.max_k) == (max(q_lens), max(k_lens))
