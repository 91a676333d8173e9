"""The FP8 gated MLP's activation quantization: Inductor's kernels against the fused op
(docs/quantization.md, "The quantization kernels").

At each row count, SiLU(gate) * up quantized per row for the down projection (8B width, bf16), as
the engine ran it before the fused op (the plain-torch quantize_rows after the product, compiled by
Inductor: a split reduction and a quantization that computes the product again) and as the fused
op runs it (one Triton program per row), each timed as a captured step runs it (50 calls in one CUDA
graph, the best of 5 replays), with the fraction of e4m3 values the two give apart.

CUDA only: `python scripts/fp8_mlp_quantization.py [--rows 1,8,32,256,1024,8192] [--out r.json]`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.service.engine.ops.fp8_linear import quantize_rows
from tandem.service.engine.ops.fp8_mlp import silu_mul_quant

WIDTH = 14336  # the 8B shape's intermediate size


def inductors(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(F.silu(gate_up[:, :WIDTH]) * gate_up[:, WIDTH:])


def graph_us(fn: Callable[[torch.Tensor], object], x: torch.Tensor, calls: int = 50) -> float:
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,256,1024,8192")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    compiled = torch.compile(inductors, dynamic=False)
    result: dict = {"gpu": torch.cuda.get_device_name(), "width": WIDTH, "rows": []}
    for rows in (int(r) for r in a.rows.split(",")):
        gate_up = (torch.randn(rows, 2 * WIDTH, device="cuda") * 3).bfloat16()
        (q_inductor, _), (q_fused, _) = compiled(gate_up), silu_mul_quant(gate_up)
        row = {"rows": rows, "us_inductor": round(graph_us(compiled, gate_up), 2),
               "us_fused": round(graph_us(silu_mul_quant, gate_up), 2),
               "e4m3_apart": (q_inductor.float() != q_fused.float()).float().mean().item()}
        row["ratio"] = round(row["us_fused"] / row["us_inductor"], 3)
        result["rows"].append(row)
        print(row, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
