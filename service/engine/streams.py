"""The step loop's CUDA streams, and running work on one of them (or inline, on the CPU)."""

from __future__ import annotations

import contextlib

import torch


class Streams:
    """h2d, compute and d2h carry a step's three stages (model_runner.py); offload carries the KV
    copies to and from the host pool (kv_offload.py), apart so that no step's tokens wait behind them."""

    def __init__(self, device: torch.device) -> None:
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.offload = torch.cuda.Stream(device)


def on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Queue the block's work on `stream`; None (the CPU): run it where it is."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
