"""The GEMM floor of a workload: its run time if the model's GEMMs were all the device did.

The bandwidth roofline assumes every step only reads memory. A large batch is compute-bound in its
GEMMs instead, and the prefill always is, so the roofline can be out of reach of any engine. This
measures what the GEMM library itself attains: each weight shape of the model (the engine's, so
fused projections count as one) is timed alone at the step's row count, every call reading another
copy of the weight (none served from L2). The floor of a workload adds up, per step, its GEMMs
and, for decode steps, the K/V read at the copy bandwidth; norms, activations, attention compute,
sampling and launch gaps count as free. roofline seconds / floor seconds is then the highest share
of the roofline that the device's GEMMs allow. A model whose linear layers run in FP8 (W8A8:
ops/fp8_linear.py) has them timed through the engine's FP8 GEMM, its input already quantized (the
quantization counts as free, as the norms it is fused into do): the FP8 engine's own floor.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], reps: int = 20, cuda: bool = True) -> float:
    """Seconds per call; on CUDA from a graph of `reps` calls (no launch gaps)."""
    fn()
    if not cuda:  # the CPU smoke run: a plain loop
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (5 * reps)


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def time_linear(x: torch.Tensor, out_features: int, in_features: int, l2_bytes: int = 256 << 20,
                linear: Linear = torch.nn.functional.linear) -> float:
    """Seconds of `linear`(x, W) = x @ W.T for a [out, in] weight, each call reading another copy of W."""
    nbytes = out_features * in_features * x.element_size()
    copies = [torch.randn(out_features, in_features, dtype=x.dtype, device=x.device)
              for _ in range(-(-l2_bytes // nbytes))]
    turn = iter(range(10**9))
    return timed(lambda: linear(x, copies[next(turn) % len(copies)]), cuda=x.is_cuda)


def linear_shapes(model: torch.nn.Module) -> tuple[Counter, tuple[int, int]]:
    """Each [out, in] GEMM weight shape of the model with its count, the LM head apart (it runs on
    the sampled rows only). Any module's own 2-D `weight` but an embedding's is a GEMM's, so
    fused projections (one weight for Q/K/V) count once, as the engine runs them."""
    head = model.get_output_embeddings()
    shapes: Counter = Counter()
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None or weight.dim() != 2 or module is head or isinstance(module, torch.nn.Embedding):
            continue
        shapes[tuple(weight.shape)] += 1
    return shapes, tuple(head.weight.shape)


def time_fp8_linear(rows: int, out_features: int, in_features: int, device: torch.device,
                    out_dtype: torch.dtype, l2_bytes: int = 256 << 20) -> float:
    """Seconds of the engine's FP8 GEMM (e4m3 operands, a scale per row and per output channel:
    ops/fp8_linear.scaled_mm) at `rows` rows, each call reading another copy of W."""
    from tandem.service.engine.ops.fp8_linear import quantize_rows, scaled_mm

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.bfloat16, device=device)

    xq, x_scale = quantize_rows(random(rows, in_features))
    weight, weight_scale = quantize_rows(random(out_features, in_features))
    weight_scale = weight_scale.reshape(1, out_features).contiguous()
    copies = [weight.clone() for _ in range(-(-l2_bytes // weight.nbytes))]
    turn = iter(range(10**9))
    return timed(lambda: scaled_mm(xq, x_scale, copies[next(turn) % len(copies)], weight_scale, out_dtype),
                 cuda=xq.is_cuda)


def fp8_shapes(model: torch.nn.Module) -> set[tuple[int, int]]:
    """The [out, in] weight shapes of the model's linear layers that run in FP8."""
    from tandem.service.engine.ops.fp8_linear import Fp8Linear

    return {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, Fp8Linear)}


def forward_gemm_seconds(model: torch.nn.Module, rows: int, sampled: int) -> float:
    """One forward's GEMMs alone: every linear at `rows` rows, the LM head at `sampled`."""
    return body_gemm_seconds(model, rows) + head_gemm_seconds(model, sampled)


def body_gemm_seconds(model: torch.nn.Module, rows: int) -> float:
    """Every linear of the model but the LM head, alone at `rows` rows (in FP8 those that run in it)."""
    from tandem.service.engine.ops.fp8_linear import compute_dtype

    p = next(model.parameters())
    dtype = compute_dtype(model)
    shapes, _head = linear_shapes(model)
    fp8 = fp8_shapes(model)

    def seconds(out_f: int, in_f: int) -> float:
        if (out_f, in_f) in fp8:
            return time_fp8_linear(rows, out_f, in_f, p.device, dtype)
        return time_linear(torch.randn(rows, in_f, dtype=dtype, device=p.device), out_f, in_f)

    return sum(count * seconds(out_f, in_f) for (out_f, in_f), count in shapes.items())


def head_gemm_seconds(model: torch.nn.Module, rows: int) -> float:
    """The LM head alone at `rows` rows (the sampled ones)."""
    from tandem.service.engine.ops.fp8_linear import compute_dtype

    p = next(model.parameters())
    _shapes, head = linear_shapes(model)
    return time_linear(torch.randn(rows, head[1], dtype=compute_dtype(model), device=p.device), *head)


class StepGemmFloor:
    """Any step's GEMM floor: its linears at its row count (prompt tokens + decode rows), the LM head
    at its sampled rows, each timed once per `bucket` rows (rounded up: a floor a little high at
    most), plus its decode rows' K/V read at the copy bandwidth. For workloads whose steps differ in
    size, where `workload_floor`'s fixed shape does not apply."""

    def __init__(self, model: torch.nn.Module, kv_per_token: int, bandwidth: float, bucket: int = 16) -> None:
        self.model, self.kv_per_token, self.bandwidth, self.bucket = model, kv_per_token, bandwidth, bucket
        self._body: dict[int, float] = {}
        self._head: dict[int, float] = {}

    def _rounded(self, rows: int) -> int:
        return -(-max(1, rows) // self.bucket) * self.bucket

    def seconds(self, rows: int, sampled: int, decode_context: int) -> float:
        body, head = self._rounded(rows), self._rounded(sampled)
        if body not in self._body:
            self._body[body] = body_gemm_seconds(self.model, body)
        if head not in self._head:
            self._head[head] = head_gemm_seconds(self.model, head)
        return self._body[body] + self._head[head] + decode_context * self.kv_per_token / self.bandwidth


def workload_floor(
    model: torch.nn.Module, kv_per_token: int, bandwidth: float, requests: int, prompt: int, new: int,
    max_num_seqs: int, max_num_batched_tokens: int,
) -> dict | None:
    """Floor of `requests` prompts of `prompt` tokens, each decoding `new` tokens, all at once:
    prefill in chunks of the step budget, then `new - 1` decode steps of every request. None when
    the requests do not fit in one batch (the floor would depend on the scheduling of waves)."""
    if requests > max_num_seqs:
        return None
    prompt_tokens = requests * prompt
    chunk = min(max_num_batched_tokens, prompt_tokens)
    chunks = -(-prompt_tokens // chunk)
    prefill = chunks * forward_gemm_seconds(model, chunk, max(1, chunk // prompt))
    decode_gemm = forward_gemm_seconds(model, requests, requests)
    kv_read = sum(requests * (prompt + j) * kv_per_token / bandwidth for j in range(1, new))
    decode = (new - 1) * decode_gemm + kv_read
    return {
        "prefill_steps": chunks,
        "prefill_tokens_per_step": chunk,
        "prefill_seconds": round(prefill, 4),
        "decode_gemm_ms_per_step": round(1e3 * decode_gemm, 3),
        "decode_kv_read_seconds": round(kv_read, 4),
        "seconds": round(prefill + decode, 4),
        "tok_s": round(requests * max(1, new - 1) / (prefill + decode), 1),
    }
