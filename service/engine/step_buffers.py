"""One input/output slot of the step loop: pinned host staging and device buffers of one layout.

The asynchronous loop alternates two slots, so the CPU fills slot B while the device still reads
slot A. Every buffer has a fixed address, which is what lets a CUDA graph captured for a slot
read its inputs and write its sampled tokens without any per-step allocation.
"""

from __future__ import annotations

import torch

from .batch import DeviceBatch, HostBatch, SamplingTensors

_PER_DECODE = ("decode_idx", "ctx_lens")


class StepBuffers:
    # (name, dtype, rows: "tokens" | "seqs", padding value of unused graph rows)
    _VECTORS = (
        ("input_ids", torch.int64, "tokens"),
        ("positions", torch.int64, "tokens"),
        ("slot_mapping", torch.int64, "tokens"),
        ("carry", torch.int64, "tokens"),
        ("logits_indices", torch.int64, "seqs"),
        ("decode_idx", torch.int64, "seqs"),
        ("ctx_lens", torch.int32, "seqs"),
        ("temperature", torch.float32, "seqs"),
        ("top_p", torch.float32, "seqs"),
        ("top_k", torch.int64, "seqs"),
        ("seeds", torch.int64, "seqs"),
        ("steps", torch.int64, "seqs"),
    )

    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device, scratch_block: int,
        block_size: int,
    ) -> None:
        self.device = device
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        pin = device.type == "cuda"
        sizes = {"tokens": max(max_tokens, max_seqs), "seqs": max_seqs}
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, dtype, rows in self._VECTORS:
            self.host[name] = torch.zeros(sizes[rows], dtype=dtype, pin_memory=pin)
            self.dev[name] = torch.zeros(sizes[rows], dtype=dtype, device=device)
        self.host["block_table"] = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.dev["block_table"] = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        # the step's sampled tokens: the next step's carried inputs read them on the device
        self.tokens = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.tokens_host = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin)
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

    def upload(self, batch: HostBatch, pad_to: int | None = None) -> DeviceBatch:
        """Stage `batch` in pinned memory and queue its copies to the device (current stream).

        `pad_to`: a decode graph's bucket; rows past the batch get inputs that touch only the
        scratch block (one token of context, greedy), so the graph's padding rows are harmless.
        """
        n_tok = len(batch.input_ids)
        n_seq = len(batch.logits_indices)
        n_dec = len(batch.decode_token_idx)
        s = batch.sampling
        values = {
            "input_ids": batch.input_ids,
            "positions": batch.positions,
            "slot_mapping": batch.slot_mapping,
            "carry": batch.carry,
            "logits_indices": batch.logits_indices,
            "decode_idx": torch.tensor(batch.decode_token_idx, dtype=torch.int64),
            "ctx_lens": batch.decode_ctx_lens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seeds": s.seeds,
            "steps": s.steps,
        }
        rows = {"tokens": n_tok, "seqs": n_seq}
        padded = {"tokens": pad_to or n_tok, "seqs": pad_to or n_seq}
        h = self.host
        for name, _, kind in self._VECTORS:
            n = n_dec if name in _PER_DECODE else rows[kind]
            src = values[name]
            if src is None:  # nothing carried
                h[name][:n].fill_(-1)
            else:
                h[name][:n].copy_(src)
        if batch.decode_block_table is not None:
            width = batch.decode_block_table.shape[1]
            h["block_table"][:n_dec, :width].copy_(batch.decode_block_table)
        if pad_to is not None and pad_to > n_tok:
            pad = slice(n_tok, pad_to)
            for name, fill in (
                ("input_ids", 0), ("positions", 0), ("slot_mapping", self.scratch_slot), ("carry", -1),
                ("ctx_lens", 1), ("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("seeds", 0),
                ("steps", 0),
            ):
                h[name][pad].fill_(fill)
            h["logits_indices"][pad].copy_(torch.arange(n_tok, pad_to))
            h["decode_idx"][pad].copy_(torch.arange(n_tok, pad_to))
            h["block_table"][pad, 0].fill_(self.scratch_block)
        for name, _, kind in self._VECTORS:
            n = (pad_to or n_dec) if name in _PER_DECODE else padded[kind]
            self.dev[name][:n].copy_(h[name][:n], non_blocking=True)
        n_rows = pad_to or n_dec
        if n_rows:
            self.dev["block_table"][:n_rows].copy_(h["block_table"][:n_rows], non_blocking=True)
        width = batch.decode_block_table.shape[1] if batch.decode_block_table is not None else 0
        return self.view(n_tok, n_seq, n_dec, width, s.all_greedy, s.needs_filter, s.num_logprobs)

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
        d = self.dev
        sampling = SamplingTensors(
            temperature=d["temperature"][:n_seq],
            top_p=d["top_p"][:n_seq],
            top_k=d["top_k"][:n_seq],
            seeds=d["seeds"][:n_seq],
            steps=d["steps"][:n_seq],
            all_greedy=all_greedy,
            needs_filter=needs_filter,
            num_logprobs=num_logprobs,
        )
        return DeviceBatch(
            input_ids=d["input_ids"][:n_tok],
            positions=d["positions"][:n_tok],
            slot_mapping=d["slot_mapping"][:n_tok],
            carry=d["carry"][:n_tok],
            logits_indices=d["logits_indices"][:n_seq],
            decode_idx=d["decode_idx"][:n_dec],
            block_table=d["block_table"][:n_dec, :width],
            ctx_lens=d["ctx_lens"][:n_dec],
            sampling=sampling,
        )
