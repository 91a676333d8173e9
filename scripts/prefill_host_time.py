"""What a short prompt's step costs the host through the engine core, with the cache-writing ops'
version bump and without. By default a random Llama of negligible width (64) and `--layers` layers
on the CPU, so a request's time is the host's (the compiled calls, the custom ops' dispatch, the
launches); `--shape 8b` builds the 8B shape on CUDA with the server's CUDA defaults (CUDA graphs,
fused projections, folded rotary) instead. Each request is one prompt of 20-48 tokens and one new
token on an idle engine (a TTFT's step). In one process per compile scope, blocks of `--block`
requests alternate between the engine's dispatch (ops/inference_ops.py: past autograd's version
bump) and torch.library.custom_op's default (the bump's Python kernel, restored by dropping the
engine's registration), so both see the same host.

    python scripts/prefill_host_time.py                      # 32 layers, Inductor, one thread
    python scripts/prefill_host_time.py --scopes layer --blocks 10
    python scripts/prefill_host_time.py --shape 8b --scopes layer,model   # a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.bench.common import SHAPES
from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.engine_core import EngineCore
from tandem.service.engine.ops import decode_op, inference_ops, mixed_op  # noqa: F401  (the ops)

LENGTHS = (20, 27, 34, 41, 48)
OPS = tuple(inference_ops.SKIPPED)  # the engine's ops that skip the bump (both attention ops)


def dispatch(version_bumps: bool) -> None:
    """The ops' ADInplaceOrView kernel: custom_op's own (bumps) or the engine's fallthrough."""
    inference_ops._LIBRARY._destroy()
    inference_ops._LIBRARY = torch.library.Library("tandem", "FRAGMENT")
    if not version_bumps:
        for op in OPS:
            inference_ops.without_version_bumps(op)


def request_ms(core: EngineCore, n: int, vocab: int = 256) -> float:
    prompt = [(n * 7 + i) % (vocab - 1) + 1 for i in range(LENGTHS[n % len(LENGTHS)])]
    core.add(Request(request_id=f"r{n}", prompt_ids=prompt,
                     params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    start = time.perf_counter()
    while core.has_work:
        core.run_once()
    return 1e3 * (time.perf_counter() - start)


def build(scope: str, layers: int, shape: str | None) -> tuple[EngineCore, int]:
    """-> the engine core of `scope`, and its model's vocabulary size."""
    torch._dynamo.reset()
    if shape is not None:  # the server's CUDA defaults on a random-initialised shape
        from tandem.bench.engine.variants import build_model

        model = build_model(shape, torch.device("cuda"), torch.bfloat16)
        engine = EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                              step_loop="auto", cuda_graphs=True, compile_decode=True, compile_prefill=True,
                              fuse_projections=True, fold_rotary=True, compile_scope=scope)
        return build_core(model, engine, frozenset([0])), model.config.vocab_size
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    engine = EngineConfig(num_blocks=512, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                          compile_prefill=True, compile_scope=scope)
    return build_core(LlamaForCausalLM(config).eval(), engine, frozenset([0])), 256


def compare(scope: str, layers: int, blocks: int, block: int, shape: str | None) -> dict[bool, float]:
    """Median milliseconds a request, with the version bump (True) and without (False)."""
    core, vocab = build(scope, layers, shape)
    n = 0
    times: dict[bool, list[float]] = {True: [], False: []}
    for b in range(2 + 2 * blocks):  # the first two blocks compile (a symbolic token count after one)
        bumps = b % 2 == 0
        dispatch(bumps)
        for _ in range(block):
            ms = request_ms(core, n, vocab)
            n += 1
            if b >= 2:
                times[bumps].append(ms)
    dispatch(False)  # the engine's own
    return {bumps: statistics.median(ms) for bumps, ms in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32, help="the CPU model's layers")
    ap.add_argument("--shape", choices=("1b", "8b"), help="a random-initialised shape on CUDA instead")
    ap.add_argument("--scopes", default="model,layer")
    ap.add_argument("--blocks", type=int, default=6, help="timed blocks of each kind, alternating")
    ap.add_argument("--block", type=int, default=10, help="requests a block")
    args = ap.parse_args()
    if args.shape is None:
        torch.set_num_threads(1)
    layers = args.layers if args.shape is None else SHAPES[args.shape]["num_hidden_layers"]
    for scope in args.scopes.split(","):
        ms = compare(scope, layers, args.blocks, args.block, args.shape)
        print(f"scope {scope}, {layers} layers: {ms[True]:.2f} ms a request with the version bump, "
              f"{ms[False]:.2f} without ({1e3 * (ms[True] - ms[False]) / layers:.0f} us a layer)",
              flush=True)


if __name__ == "__main__":
    main()
