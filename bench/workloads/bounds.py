"""What bounds a workload's run: the additive bound (decode steps' memory traffic at the copy
bandwidth plus prompt tokens' GEMM work at the GEMM rate), the GEMM floor, and both per kind of step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.bench.common import SHAPES, percentile
from tandem.bench.engine.gemm_floor import StepGemmFloor, linear_shapes, time_fp8_linear
from tandem.bench.engine.gemm_floor import timed as seconds_per_call
from tandem.bench.engine.host_step import DECODE_ROWS
from tandem.bench.workloads.timed_run import Run
from tandem.service.engine.ops.kv_cache import CacheShape


@dataclass(frozen=True)
class Device:
    weight_bytes: int
    linear_params: int  # GEMM weights a prompt token goes through (embedding and LM head apart)
    kv_per_token: int
    bandwidth: float  # bytes read + written per second, device-to-device copy
    gemm_flops: float  # dense GEMM rate, FLOP/s (the FP8 GEMM's for an engine whose linears run in FP8)

    def decode_memory_s(self, step: dict) -> float:
        """A step's decode rows' memory traffic at the copy bandwidth: every weight, their K/V."""
        if not step["decode_rows"]:
            return 0.0
        return (self.weight_bytes + step["decode_context"] * self.kv_per_token) / self.bandwidth

    def prompt_gemm_s(self, tokens: int) -> float:
        """The GEMM work of `tokens` prompt tokens at the measured GEMM rate."""
        return 2 * self.linear_params * tokens / self.gemm_flops

    def step_bound_s(self, step: dict) -> float:
        """One step at the additive bound: its decode rows' memory traffic plus its prompt GEMMs."""
        return self.decode_memory_s(step) + self.prompt_gemm_s(step["prompt"])

    def bound_s(self, steps: list[dict]) -> float:
        """Steps at the additive bound, summed step by step."""
        return sum(map(self.step_bound_s, steps))

    def additive_bound(self, steps: list[dict]) -> dict:
        decode = sum(map(self.decode_memory_s, steps))
        prompt = sum(self.prompt_gemm_s(s["prompt"]) for s in steps)
        return {
            "decode_memory_s": round(decode, 3),
            "prompt_gemm_s": round(prompt, 3),
            "seconds": round(decode + prompt, 3),
        }


def modelled_device(shape: str, bandwidth: float, gemm_flops: float) -> Device:
    """The additive bound's constants of `shape` in bf16, from a model with no storage (for the
    schedule-only runs: `--model` here, `tandem bench offload-bound`)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))
    return Device(
        weight_bytes=2 * sum(p.numel() for p in model.parameters()),
        linear_params=linear_params(model),
        kv_per_token=CacheShape.of(model.config).bytes_per_token(torch.bfloat16),
        bandwidth=bandwidth,
        gemm_flops=gemm_flops,
    )


def linear_params(model: torch.nn.Module) -> int:
    shapes, _head = linear_shapes(model)  # the GEMM weights as the engine runs them, LM head apart
    return sum(out_f * in_f * count for (out_f, in_f), count in shapes.items())


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """Dense GEMM FLOP/s of an n x n x n product (gemm_floor's timing: a CUDA graph of the calls)."""
    cuda = device.type == "cuda"
    if not cuda:
        n = 256
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, reps=10, cuda=cuda)


def fp8_gemm_rate(device: torch.device, out_dtype: torch.dtype, n: int = 8192) -> float:
    """The engine's FP8 GEMM FLOP/s (W8A8, ops/fp8_linear.scaled_mm) of an n x n x n product, its
    input already quantized: the prompt rate of an engine whose linear layers run in FP8."""
    if device.type != "cuda":
        n = 256
    return 2 * n**3 / time_fp8_linear(n, n, n, device, out_dtype)


def gemm_floor(steps: list[dict], floor: StepGemmFloor) -> float:
    """Each step's GEMM floor (its linears at its rows, the LM head at its decode rows, the K/V read),
    kept in the step as `floor_ms`; -> the run's, in seconds."""
    for s in steps:
        rows = s["prompt"] + s["decode_rows"]
        s["floor_ms"] = 1e3 * floor.seconds(rows, max(1, s["decode_rows"]), s["decode_context"])
    return sum(s["floor_ms"] for s in steps) / 1e3


def device_busy(r: Run) -> float | None:
    """The share of the run's time the compute stream spent in steps (the rest: the host's)."""
    device = [s["device_ms"] for s in r.steps if "device_ms" in s]
    return round(sum(device) / 1e3 / r.seconds, 4) if device else None


def step_kinds(steps: list[dict], limits: Device | None = None) -> dict:
    """Per kind of step: how many, their device time (and, with `limits`, their own additive
    bound and its share of that time; where the steps carry it, their GEMM floor and its share)
    and host times."""
    kinds = ("decode", "prompt", "mixed")
    return step_groups({kind: [s for s in steps if s["kind"] == kind] for kind in kinds}, limits)


def decode_by_rows(steps: list[dict], limits: Device | None = None) -> dict:
    """The decode-only steps of step_kinds, by batch size."""
    decode = [s for s in steps if s["kind"] == "decode"]
    return step_groups({f"{lo}-{hi} rows": [s for s in decode if lo <= s["decode_rows"] <= hi]
                        for lo, hi in DECODE_ROWS}, limits)


def step_groups(groups: dict[str, list[dict]], limits: Device | None) -> dict:
    out = {}
    for kind, of in groups.items():
        if not of:
            continue
        device = [s["device_ms"] for s in of if "device_ms" in s]
        bound = {}
        if limits is not None and device:
            seconds = limits.bound_s(of)
            bound = {"bound_s": round(seconds, 3), "of_bound": round(1e3 * seconds / sum(device), 4)}
        if device and all("floor_ms" in s for s in of):
            floor = sum(s["floor_ms"] for s in of)
            bound |= {"floor_s": round(floor / 1e3, 3), "of_floor": round(floor / sum(device), 4)}
        out[kind] = {
            "steps": len(of),
            "device_s": round(sum(device) / 1e3, 3) if device else None,
            **bound,
            "prepare_ms_mean": round(sum(s["prepare_ms"] for s in of) / len(of), 3),
            "launch_ms_mean": round(sum(s["launch_ms"] for s in of) / len(of), 3),
            "launch_ms_p50": round(percentile([s["launch_ms"] for s in of], 50), 3),
            "launch_ms_max": round(max(s["launch_ms"] for s in of), 3),
            "prompt_tokens_mean": round(sum(s["prompt"] for s in of) / len(of), 1),
            "decode_rows_mean": round(sum(s["decode_rows"] for s in of) / len(of), 1),
        }
    return out
