"""Drive a real engine step by step (no thread, no gRPC), with requests arriving over time."""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.sequence import Sequence


@dataclass
class Arrival:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    at_step: int = 0
    cache_scope: bytes = b""


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # prompt tokens found cached, with the first token
    preemptions: int = 0
    steps: int = 0
    max_batch: int = 0


def block_holders(seqs: list[Sequence]) -> Counter[int]:
    """Device KV block -> how many of `seqs` hold it (what its reference count must be)."""
    return Counter(b for seq in seqs for b in seq.block_ids)


def make_core(
    model: torch.nn.Module,
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    eos: frozenset[int] = frozenset(),
    cuda_graphs: bool = False,
    step_loop: str = "sync",
    compile_backend: str | None = None,
    fuse_projections: bool = False,
    kv_cache_layout: str = "NHD",
    blas_library: str = "default",
    fold_rotary: bool = True,  # the deferred model's path (the server's on CUDA) unless a test says not
    compile_prefill: bool = False,  # with compile_backend: prefill and mixed steps compiled too
    compile_decode: bool | None = None,  # default: whenever compile_backend is given
    compile_scope: str = "model",  # the whole model, or one decoder layer for every layer
    prefix_caching: bool = False,
    kv_offload_blocks: int = 0,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> EngineCore:
    config = EngineConfig(
        num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, cuda_graphs, step_loop,
        compile_decode=compile_backend is not None if compile_decode is None else compile_decode,
        compile_backend=compile_backend or "inductor",
        fuse_projections=fuse_projections, kv_cache_layout=kv_cache_layout, blas_library=blas_library,
        fold_rotary=fold_rotary, compile_prefill=compile_prefill and compile_backend is not None,
        prefix_caching=prefix_caching, kv_offload_blocks=kv_offload_blocks, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype, compile_scope=compile_scope,
    )
    return build_core(model, config, eos)


def run(core: EngineCore, arrivals: list[Arrival], max_steps: int = 10_000) -> RunResult:
    result = RunResult()
    pending = sorted(arrivals, key=lambda a: a.at_step)
    seqs = {}
    step = 0
    while (pending or core.has_work) and step < max_steps:
        while pending and pending[0].at_step <= step:
            a = pending.pop(0)
            core.add(Request(a.request_id, a.prompt_ids, a.params, a.cache_scope))
            result.tokens[a.request_id] = []
        for s in core.scheduler.waiting:
            seqs[s.request_id] = s
        result.max_batch = max(result.max_batch, len(core.scheduler.running) + len(core.scheduler.waiting))
        for out in core.run_once().values():
            for rid, _kind, message in out.failed:
                result.errors[rid] = message
            started = {row: cached for row, _at, cached in out.started}
            finished = {row: reason for row, reason, _stop in out.finished}
            for row, (rid, token) in enumerate(zip(out.request_ids, out.tokens, strict=True)):
                first = row in started
                assert first == (not result.tokens[rid]), "`started` marks a request's first token only"
                if first:
                    result.cached[rid] = started[row]
                result.tokens[rid].append(token)
                if row in finished:
                    result.finish[rid] = finished[row].value
        step += 1
    result.steps = step
    result.preemptions = sum(s.num_preemptions for s in seqs.values())
    assert not core.scheduler.has_work, "engine did not finish"
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks, "KV blocks leaked"
    host = core.scheduler.host
    # (a pool still being allocated has no block to hand out, nor any handed out)
    leaked = host is not None and host.num_free != (host.num_blocks if host.is_open else 0)
    assert not leaked, "host pool blocks leaked"
    return result


# model -> {(its weights' signature, prompt, max_new, eos): transformers' greedy tokens}. Weakly keyed: a
# model's entries go with it, and another model (even one at a dead model's address) never meets them.
_GREEDY: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, list[int]]] = weakref.WeakKeyDictionary()


def _checksum(t: torch.Tensor) -> float | int:
    return float(torch.sum(t, dtype=torch.float64)) if t.is_floating_point() else int(t.sum())


def _weights_signature(model: torch.nn.Module) -> tuple:
    """What generate() reads of the model: every parameter and buffer (where it lives, its in-place
    version counter and a checksum of its values) and the generation config, so that a model
    changed in place between two calls is never answered from the memo."""
    with torch.no_grad():
        tensors = tuple(
            (name, t.dtype, tuple(t.shape), t.device.type, t.data_ptr(), t._version, _checksum(t))
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        )
    return tensors, model.generation_config.to_json_string(use_diff=False)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, eos: list[int] | None) -> list[int]:
    """transformers' own generate(), one prompt at a time (no padding), greedy.

    Greedy decoding is deterministic, so the answer is memoized per model object and weights: the
    sync and async variants of a test (and repeated runs over the same prompts) ask it once."""
    key = (_weights_signature(model), tuple(prompt), max_new, None if eos is None else tuple(eos))
    memo = _GREEDY.setdefault(model, {})
    if key not in memo:
        memo[key] = _generate_greedy(model, prompt, max_new, eos)
    return list(memo[key])


def _generate_greedy(
    model: torch.nn.Module, prompt: list[int], max_new: int, eos: list[int] | None
) -> list[int]:
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    device = next(model.parameters()).device
    try:
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt) :].tolist()
