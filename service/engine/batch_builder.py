"""Each step's host batch; a steady decode step is derived from the step before it.

A stable batch of long generations runs steady decode steps: the same sequences as the step
before, in the same order, each one token further, every input still on the device (carried).
Such a step differs from the one before only by one position per row, a cache slot one further
(or the first of a new block) and a sampled-token index one higher, so it is derived from the
previous batch with a few array operations instead of being rebuilt row by row
(`build_host_batch`), which at 256 sequences is a fair share of the host's work per step. Any
other step is built whole.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .batch import HostBatch, build_host_batch
from .scheduler import ScheduledChunk
from .sequence import Sequence


class HostBatchBuilder:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._last: tuple[list[Sequence], HostBatch] | None = None  # the last steady decode step

    def build(self, chunks: list[ScheduledChunk], prev_rows: dict[int, int] | None = None) -> HostBatch:
        """`prev_rows`: id(sequence) -> its row in the previous step's samples, for carried chunks."""
        steady = bool(chunks) and all(c.num_tokens == 1 and c.carried and c.samples for c in chunks)
        batch = self._derived(chunks, prev_rows) if steady else None
        if batch is None:
            batch = build_host_batch(chunks, self.block_size, prev_rows=prev_rows)
        self._last = ([c.seq for c in chunks], batch) if steady else None
        return batch

    def _derived(self, chunks: list[ScheduledChunk], prev_rows: dict[int, int] | None) -> HostBatch | None:
        """The step from the last one built, if that one was steady and held the same sequences in
        the same order (each sampled into its own row, so each row's input is that row of the step
        before), each one token further; else None. `prev_rows` is None after a failed step."""
        if self._last is None or prev_rows is None:
            return None
        seqs, last = self._last
        if len(seqs) != len(chunks) or any(c.seq is not s for c, s in zip(chunks, seqs, strict=True)):
            return None
        positions = last.positions + 1
        starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        if not np.array_equal(starts, positions.numpy()):
            return None
        bs = self.block_size
        slots = last.slot_mapping + 1
        table = last.decode_block_table
        entered = torch.nonzero(positions % bs == 0).flatten().tolist()  # rows now in a new block
        if entered:
            width = int(positions.max()) // bs + 1
            grown = torch.zeros(len(chunks), max(width, table.shape[1]), dtype=table.dtype)
            grown[:, : table.shape[1]] = table
            table = grown
            for row in entered:
                pos = int(positions[row])
                block = chunks[row].seq.block_ids[pos // bs]
                table[row, pos // bs] = block
                slots[row] = block * bs
        sampling = dataclasses.replace(last.sampling, steps=last.sampling.steps + 1)
        return dataclasses.replace(
            last, positions=positions, slot_mapping=slots, decode_block_table=table,
            decode_ctx_lens=last.decode_ctx_lens + 1, sampling=sampling,
            carry=torch.arange(len(chunks)),  # each row's input: the same row of the step before
        )
