"""A step's inputs on the host (`StepInputs`), built from the scheduler's chunks by one builder.

`StepInputsBuilder.build` is the one way a step's inputs are made. A stable batch of long
generations runs steady decode steps: the same sequences as the step before, in the same order,
each one token further, every input still on the device (carried). Such a step differs from the
one before only by one position per row, a cache slot one further (or the first of a new block) and
a sampled-token index one higher, so the builder derives it from the previous step's inputs with a
few array operations instead of going through every row, which at 256 sequences is a fair share of
the host's work per step; any other step is built row by row. Both give the same inputs (a
hypothesis test checks every step of random workloads).
"""

from __future__ import annotations

import dataclasses
from array import array

import numpy as np
import torch

from .batch import PromptRows, SamplingTensors, StepInputs
from .scheduler import ScheduledChunk
from .sequence import Sequence


class StepInputsBuilder:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._last: tuple[list[Sequence], StepInputs] | None = None  # the last steady decode step

    def build(self, chunks: list[ScheduledChunk], prev_rows: dict[int, int] | None = None) -> StepInputs:
        """The inputs of a step of `chunks`. `prev_rows`: id(sequence) -> its row in the previous
        step's samples, for carried chunks (None: nothing is carried). A sequence that asks for
        prompt logprobs has its positions in the step's prompt rows marked as launched
        (Sequence.prompt_logprobs_next)."""
        steady = bool(chunks) and all(c.num_tokens == 1 and c.carried and c.samples for c in chunks)
        inputs = self._derived(chunks, prev_rows) if steady else None
        if inputs is None:
            inputs = self._rows(chunks, prev_rows)
        self._last = ([c.seq for c in chunks], inputs) if steady else None
        return inputs

    def _rows(self, chunks: list[ScheduledChunk], prev_rows: dict[int, int] | None) -> StepInputs:
        """The step built row by row: a decode row costs a few scalar writes, a prompt chunk and the
        block table are array copies."""
        block_size = self.block_size
        total = sum(c.num_tokens for c in chunks)
        input_ids = np.empty(total, np.int64)
        positions = np.empty(total, np.int64)
        slots = np.empty(total, np.int64)
        carry = np.full(total, -1, np.int64)
        carried = False
        logits_indices: list[int] = []
        sample_chunks: list[int] = []
        decode_token_idx: list[int] = []
        decode_tables: list[array] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, array | None]] = []
        temps, top_ps, top_ks, seeds, steps = [], [], [], [], []
        num_logprobs = -1
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_chunks: list[tuple[int, int]] = []
        prompt_top = 0

        q = 0  # the chunk's first row in the packed step
        for ci, chunk in enumerate(chunks):
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            blocks = seq.block_ids
            if n == 1:
                input_ids[q] = 0 if chunk.carried else seq.token_ids[start]
                positions[q] = start
                slots[q] = blocks[start // block_size] * block_size + start % block_size
                decode_token_idx.append(q)
                decode_tables.append(blocks)
                decode_lens.append(start + 1)
            else:
                known = seq.token_ids[start : start + n]  # n tokens, or n - 1 with the last in flight
                input_ids[q : q + len(known)] = known
                positions[q : q + n] = np.arange(start, start + n)
                slots[q : q + n] = _chunk_slots(blocks, start, n, block_size)
                prefills.append((q, n, start + n, None if start == 0 else blocks[:]))
            if chunk.carried:  # its input is still on the device: placeholder + where to take it from
                input_ids[q + n - 1] = 0
                carry[q + n - 1] = prev_rows[id(seq)]
                carried = True
            if chunk.samples:
                p = seq.params
                logits_indices.append(q + n - 1)
                sample_chunks.append(ci)
                temps.append(p.temperature)
                top_ps.append(p.top_p)
                top_ks.append(p.top_k)
                seeds.append(seq.seed)
                steps.append(seq.num_output + seq.num_inflight - 1)  # this token's index in the output
                if p.logprobs:
                    num_logprobs = max(num_logprobs, p.top_logprobs)
            if start + 1 < seq.prompt_len and (first := seq.prompt_logprobs_from) is not None:
                # its prompt positions in this chunk whose logits no launched step computes yet
                lo, hi = max(start, first), min(start + n, seq.prompt_len - 1)
                if hi > lo:
                    prompt_rows.extend(range(q + lo - start, q + hi - start))
                    prompt_targets.extend(seq.token_ids[lo + 1 : hi + 1])
                    prompt_chunks.append((ci, hi - lo))
                    prompt_top = max(prompt_top, seq.params.prompt_logprobs)
                    seq.prompt_logprobs_next = hi
            q += n

        sampling = SamplingTensors(
            temperature=torch.tensor(temps, dtype=torch.float32),
            top_p=torch.tensor(top_ps, dtype=torch.float32),
            top_k=torch.tensor(top_ks, dtype=torch.int64),
            seeds=torch.tensor(seeds, dtype=torch.int64),
            steps=torch.tensor(steps, dtype=torch.int64),
            all_greedy=all(t == 0.0 for t in temps),
            needs_filter=any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps),
            num_logprobs=num_logprobs,
        )
        return StepInputs(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            sample_chunks=sample_chunks,
            decode_token_idx=decode_token_idx,
            decode_block_table=_block_table(decode_tables) if decode_tables else None,
            decode_ctx_lens=torch.tensor(decode_lens, dtype=torch.int64) if decode_tables else None,
            prefills=prefills,
            sampling=sampling,
            carry=torch.from_numpy(carry) if carried else None,
            prompt=PromptRows(
                torch.tensor(prompt_rows, dtype=torch.int64),
                torch.tensor(prompt_targets, dtype=torch.int64),
                prompt_chunks,
                prompt_top,
            ) if prompt_rows else None,
        )

    def _derived(
        self, chunks: list[ScheduledChunk], prev_rows: dict[int, int] | None
    ) -> StepInputs | None:
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


def _chunk_slots(blocks: array, start: int, n: int, block_size: int) -> np.ndarray:
    """Cache slots of positions start .. start + n - 1 of a sequence with these blocks."""
    first, last = start // block_size, (start + n - 1) // block_size
    ids = np.array(blocks[first : last + 1], np.int64)
    offset = start % block_size
    return (ids[:, None] * block_size + np.arange(block_size)).ravel()[offset : offset + n]


def _block_table(tables: list[array]) -> torch.Tensor:
    """[rows, longest] int32: each row's block ids, then zeros (the kernels read a row up to its
    context length only)."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    table = np.zeros((len(tables), int(lens.max())), np.int32)
    table[np.arange(table.shape[1]) < lens[:, None]] = np.frombuffer(b"".join(tables), np.intc)
    return torch.from_numpy(table)
