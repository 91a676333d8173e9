"""Shared benchmark helpers: drive Tandem's EngineCore and transformers' `generate_batch` on the same
prompts, time them after a warm-up run, and write JSON / markdown.

Only `tandem.service.engine.*` (and `tandem.service.models.*` where a script loads the real model) are
imported: no settings (pydantic-settings), no gRPC, no asyncio, so this runs on a bare GPU host that has
only torch and transformers. `_repo` maps `tandem.service` onto service/ without installing the package.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import _repo  # noqa: F401  (must come before any tandem import)
import torch
import transformers

from tandem.service.engine.attention import register
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.kv_cache import CacheShape, KVCache
from tandem.service.engine.model_runner import ModelRunner
from tandem.service.engine.sampling_params import GenerationRequest, SamplingParams
from tandem.service.engine.scheduler import Scheduler

T = TypeVar("T")


@dataclass(frozen=True)
class EngineSpec:
    """The engine settings a benchmark picks (the server reads the same from ServerSettings)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048


@dataclass
class RunStats:
    """One timed generation: every request produced exactly `new_tokens` tokens."""

    name: str
    seconds: float
    tokens: int
    steps: int | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "outputs"}
        out["tok_s"] = round(self.tok_s, 1)
        out["seconds"] = round(self.seconds, 3)
        if self.steps:
            out["ms_per_step"] = round(1e3 * self.seconds / self.steps, 2)
        return out


def blocks_for(num_requests: int, tokens_per_request: int, block_size: int, margin: float = 1.25) -> int:
    """KV blocks that hold every request at full length at once, with some margin."""
    per_request = -(-tokens_per_request // block_size)
    return int(num_requests * per_request * margin) + 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# -- Tandem ----------------------------------------------------------------------------------------


def build_core(model: torch.nn.Module, spec: EngineSpec) -> EngineCore:
    """Wire EngineCore around `model` by hand, as service/engine/factory.py does minus the settings."""
    model.set_attn_implementation(register())
    device = model_device(model)
    dtype = next(model.parameters()).dtype
    cache = KVCache(CacheShape.of(model.config), spec.num_blocks, spec.block_size, dtype, device)
    scheduler = Scheduler(
        BlockManager(spec.num_blocks, spec.block_size), spec.max_num_seqs, spec.max_num_batched_tokens
    )
    capacity = spec.num_blocks * spec.block_size
    model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None) or capacity
    return EngineCore(
        ModelRunner(model, cache, device), scheduler, min(model_len, capacity), frozenset(), lambda u: None
    )


def run_tandem(core: EngineCore, prompts: Sequence[list[int]], new_tokens: int, tag: str = "") -> RunStats:
    """Add every request, then call `core.step()` until all are done; greedy, exactly `new_tokens` each."""
    core.runner.model.set_attn_implementation(register())  # generate_batch may have switched it
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    device = core.runner.device
    sync(device)
    start, first_step = time.perf_counter(), core.steps
    for rid, prompt in zip(ids, prompts):
        core.add(GenerationRequest(rid, list(prompt), params))
    core._drain(block=False)  # EngineCore has no public synchronous admit; its thread loop does this
    while core.scheduler.has_work:
        before = core.steps
        for update in core.step():
            if update.error:
                raise RuntimeError(f"{update.request_id}: {update.error}")
            outputs[update.request_id] += update.new_token_ids
        if core.steps == before:
            raise RuntimeError("the scheduler scheduled nothing while work was pending")
    sync(device)
    seconds = time.perf_counter() - start
    return _checked("tandem", seconds, [outputs[r] for r in ids], new_tokens, core.steps - first_step)


# -- transformers ----------------------------------------------------------------------------------


def run_hf(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    new_tokens: int,
    cb_config: dict | None = None,
    attn: str = "sdpa",
) -> RunStats:
    """transformers' continuous batching, `generate_batch`, greedy, fixed length.

    eos_token_id=-1 disables the stop token (transformers drops negative ids), so every request runs
    `new_tokens`. generate_batch switches `attn` to `paged|attn` for the call and restores it after.
    """
    from transformers import GenerationConfig
    from transformers.generation import configuration_utils as cu

    model.set_attn_implementation(attn)  # Tandem leaves `tandem_paged` set, which generate_batch can't use
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs = {}
    cbc_class = getattr(cu, "ContinuousBatchingConfig", None)
    if cbc_class is not None:
        kwargs["continuous_batching_config"] = cbc_class(**(cb_config or {}))
    device = model_device(model)
    sync(device)
    start = time.perf_counter()
    out = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=gen, progress_bar=False,
                               **kwargs)
    sync(device)
    seconds = time.perf_counter() - start
    results = list(out.values())
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"generate_batch failed: {errors[0]}")
    if len(results) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} requests")
    # the dict comes back in input order
    return _checked("transformers", seconds, [r.generated_tokens for r in results], new_tokens)


def _checked(name: str, seconds: float, outputs: list[list[int]], new_tokens: int, steps: int | None = None
             ) -> RunStats:
    short = [len(o) for o in outputs if len(o) != new_tokens]
    if short:
        raise RuntimeError(f"{name}: {len(short)} requests did not produce {new_tokens} tokens ({short[:4]})")
    return RunStats(name, seconds, sum(len(o) for o in outputs), steps, outputs)


def same_outputs(a: RunStats, b: RunStats) -> int:
    """How many requests got identical tokens from both runs (greedy: a correctness cross-check)."""
    return sum(x == y for x, y in zip(a.outputs, b.outputs))


# -- timing, environment, output -------------------------------------------------------------------


def warm_then_time(run: Callable[[], T]) -> tuple[T, float]:
    """Run once to warm up (allocations, kernels, graph capture), then again; return the second run
    and the warm-up's wall time."""
    start = time.perf_counter()
    run()
    warm = time.perf_counter() - start
    return run(), warm


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 1024**3, reps: int = 20) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    seconds = (time.perf_counter() - start) / reps
    del x, y
    return 2 * nbytes / seconds


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(device: torch.device) -> dict:
    env = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return f"{v:,.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
