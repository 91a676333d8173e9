"""One input/output slot of the step loop: pinned host staging and device buffers of one layout.

The asynchronous loop alternates two slots, so the CPU fills slot B while the device still reads
slot A. Every buffer has a fixed address, which is what lets a CUDA graph captured for a slot
read its inputs and write its sampled tokens without any per-step allocation.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Literal

import torch

from .batch import DeviceBatch, SamplingTensors, StepInputs

# which of a step's counts a buffer's rows follow: packed tokens, sampled rows or decode rows
Rows = Literal["tokens", "seqs", "decodes"]


class Pad(enum.Enum):
    """Padding values that depend on the slot or the row rather than being constants."""

    SCRATCH_SLOT = enum.auto()  # the scratch block's first cache slot: K/V written where no sequence reads
    SCRATCH_BLOCK = enum.auto()  # a block table whose first block is the scratch block
    OWN_ROW = enum.auto()  # the padding row's own index: in range, and its own token


@dataclass(frozen=True)
class Field:
    """One buffer of a slot: the field of its name in StepInputs and DeviceBatch, or in their
    SamplingTensors."""

    name: str
    dtype: torch.dtype
    rows: Rows
    pad: float | Pad  # what a graph's padding rows hold: inputs that touch only the scratch block
    sampling: bool = False  # a field of the step's SamplingTensors
    wide: bool = False  # [rows, max_blocks], of which a step uses its own columns

    @functools.cached_property
    def _get(self) -> Callable[[StepInputs], object]:
        return attrgetter(f"sampling.{self.name}" if self.sampling else self.name)

    def read(self, inputs: StepInputs) -> torch.Tensor | None:
        value = self._get(inputs)
        return torch.tensor(value, dtype=self.dtype) if isinstance(value, list) else value


# every buffer of a slot, in the order the upload copies them
FIELDS = (
    Field("input_ids", torch.int64, "tokens", 0),
    Field("positions", torch.int64, "tokens", 0),
    Field("slot_mapping", torch.int64, "tokens", Pad.SCRATCH_SLOT),
    Field("carry", torch.int64, "tokens", -1),  # -1: not carried
    Field("logits_indices", torch.int64, "seqs", Pad.OWN_ROW),
    Field("decode_token_idx", torch.int64, "decodes", Pad.OWN_ROW),
    Field("decode_ctx_lens", torch.int32, "decodes", 1),  # one token: the scratch slot
    Field("temperature", torch.float32, "seqs", 0.0, sampling=True),  # greedy
    Field("top_p", torch.float32, "seqs", 1.0, sampling=True),
    Field("top_k", torch.int64, "seqs", 0, sampling=True),
    Field("seeds", torch.int64, "seqs", 0, sampling=True),
    Field("steps", torch.int64, "seqs", 0, sampling=True),
    Field("decode_block_table", torch.int32, "decodes", Pad.SCRATCH_BLOCK, wide=True),
)


class StepBuffers:
    def __init__(
        self, max_num_batched_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device,
        scratch_block: int, block_size: int,
    ) -> None:
        """Rows for a step of up to `max_num_batched_tokens` tokens and `max_num_seqs` sequences
        (the runner's: its config's; a test's or a benchmark's: one step's own), each sequence's
        block table `max_blocks` wide."""
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        pin = device.type == "cuda"
        sizes = {
            "tokens": max(max_num_batched_tokens, max_num_seqs), "seqs": max_num_seqs, "decodes": max_num_seqs
        }
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for f in FIELDS:
            shape = (sizes[f.rows], max_blocks) if f.wide else (sizes[f.rows],)
            self.host[f.name] = torch.zeros(shape, dtype=f.dtype, pin_memory=pin)
            self.dev[f.name] = torch.zeros(shape, dtype=f.dtype, device=device)
        # the step's sampled tokens: the next step's carried inputs read them on the device
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.tokens_host = torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin)
        self._staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # stage(): name -> (host, device)

    def stage(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """A step's tensor of no fixed size (the packed prompt chunks' indexes) on the device,
        through this slot's staging buffer of that name (pinned on CUDA), grown when a step needs
        more; the copy is queued on the current stream. No pinned allocation per step: by the time
        the loop fills this slot again, the step that last used it is done."""
        n = values.numel()
        host, dev = self._staged.get(name, (None, None))
        if host is None or host.numel() < n or host.dtype != values.dtype:
            size = max(n, 2 * host.numel() if host is not None else 1024)
            host = torch.empty(size, dtype=values.dtype, pin_memory=self.device.type == "cuda")
            dev = torch.empty(size, dtype=values.dtype, device=self.device)
            self._staged[name] = (host, dev)
        host[:n].copy_(values.flatten())
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n].view(values.shape)

    def upload(self, batch: StepInputs, pad_to: int | None = None) -> DeviceBatch:
        """Stage `batch` in pinned memory and queue its copies to the device (current stream).

        `pad_to`: a decode graph's bucket; rows past the batch get inputs that touch only the
        scratch block (one token of context, greedy), so the graph's padding rows are harmless.
        """
        n_tok = len(batch.input_ids)
        n_seq = len(batch.logits_indices)
        n_dec = len(batch.decode_token_idx)
        in_use = {"tokens": n_tok, "seqs": n_seq, "decodes": n_dec}
        h = self.host
        for f in FIELDS:
            staged = h[f.name][: in_use[f.rows]]
            src = f.read(batch)
            if src is None:  # nothing carried
                staged.fill_(-1)
            elif f.wide:  # the step's columns; the kernels read a row up to its context only
                staged[:, : src.shape[1]].copy_(src)
            else:
                staged.copy_(src)
        if pad_to is not None and pad_to > n_tok:
            self._pad(h, slice(n_tok, pad_to))
        for f in FIELDS:
            n = pad_to or in_use[f.rows]
            if n:  # no empty copies: each is a call into torch
                self.dev[f.name][:n].copy_(h[f.name][:n], non_blocking=True)
        width = batch.decode_block_table.shape[1] if batch.decode_block_table is not None else 0
        s = batch.sampling
        return self.view(n_tok, n_seq, n_dec, width, s.all_greedy, s.needs_filter, s.num_logprobs)

    def pad_device_rows(self) -> None:
        """Make every device row a padding row: graph capture runs whole buckets before any step
        has uploaded its inputs."""
        self._pad(self.dev, slice(0, None))

    def _pad(self, buffers: dict[str, torch.Tensor], rows: slice) -> None:
        """Write each field's padding value into these rows of `buffers` (the host's or the device's)."""
        for f in FIELDS:
            t = buffers[f.name][rows]
            if f.pad is Pad.OWN_ROW:
                t.copy_(torch.arange(rows.start, rows.start + len(t), device=t.device))
            elif f.pad is Pad.SCRATCH_SLOT:
                t.fill_(self.scratch_slot)
            elif f.pad is Pad.SCRATCH_BLOCK:
                t[:, 0].fill_(self.scratch_block)
            else:
                t.fill_(f.pad)

    def padded_logits_indices(self, n_seq: int, rows: int) -> torch.Tensor:
        """The step's `n_seq` sampled rows' indexes, padded with index 0 up to `rows`, in this
        slot's own device buffer (so the tensor is of the same kind as an unpadded step's)."""
        buffer = self.dev["logits_indices"]
        buffer[n_seq:rows].zero_()
        return buffer[:rows]

    def view(
        self,
        n_tok: int,
        n_seq: int,
        n_dec: int,
        width: int,
        all_greedy: bool,
        needs_filter: bool = False,
        num_logprobs: int = -1,
    ) -> DeviceBatch:
        """The first rows of the device buffers; `width`: block-table columns in use."""
        in_use = {"tokens": n_tok, "seqs": n_seq, "decodes": n_dec}
        batch: dict[str, torch.Tensor] = {}
        sampling: dict[str, torch.Tensor] = {}
        for f in FIELDS:
            t = self.dev[f.name][: in_use[f.rows]]
            (sampling if f.sampling else batch)[f.name] = t[:, :width] if f.wide else t
        return DeviceBatch(**batch, sampling=SamplingTensors(
            **sampling, all_greedy=all_greedy, needs_filter=needs_filter, num_logprobs=num_logprobs))
