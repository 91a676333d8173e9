"""FP8 linear layers (W8A8): e4m3 weights with a scale per output channel, activations quantized
per token as they run, one scaled GEMM.

A decode step reads every weight once, so its time is the weights' bytes over the memory
bandwidth: e4m3 weights halve them, and Hopper's FP8 tensor cores run the prompt GEMMs at twice
the bf16 rate. The scheme is what published "FP8-dynamic" checkpoints hold (compressed-tensors'
float-quantized weights, channel strategy; dynamic per-token activations), so a checkpoint's
weights and a bf16 model quantized at load run the same layer. The activation's quantization is
plain torch: torch.compile fuses it into the kernels around it, and CUDA graphs capture it.
The GEMM: on CUDA Triton kernels for a decode step's rows (triton_fp8_gemm.py up to 32 rows,
triton_fp8_gemm_swapped.py up to 128 or 256) and `torch._scaled_mm` for more; on the CPU
`torch._scaled_mm`'s reference implementation (slow, for tests and accuracy runs).
"""

from __future__ import annotations

import torch
from torch import nn

from .e4m3 import FP8, FP8_MAX, quantize

# a row of zeros still gets a scale a division can use (its values quantize to 0 either way)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# cuBLASLt's FP8 GEMMs need both dimensions of the weight in multiples of 16
GEMM_MULTIPLE = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], float32 scales [..., 1]): each row scaled so its largest
    magnitude is FP8_MAX (x ~= q * scale)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize(x, scale), scale


def fits_fp8_gemm(linear: nn.Linear) -> bool:
    return linear.in_features % GEMM_MULTIPLE == 0 and linear.out_features % GEMM_MULTIPLE == 0


# CUDA: up to SMALL_ROWS rows (a decode step's batch) the few-row kernel, which streams the
# weights once (one program's rows: triton_fp8_gemm.MAX_BLOCK_M); up to SWAPPED_ROWS the swapped
# kernel (triton_fp8_gemm_swapped.py), and up to SWAPPED_NARROW_ROWS for layers no wider than deep
# (the O and down projections, whose few output tiles leave cuBLASLt's grid short of the SMs); more
# rows to torch._scaled_mm's tiled kernels (docs/quantization.md measures each layer at 1-256 rows)
SMALL_ROWS = 32
SWAPPED_ROWS = 128
SWAPPED_NARROW_ROWS = 256


def gemm_kernel(m: int, n: int, k: int) -> str:
    """The kernel an [m, k] x [n, k]^T FP8 product runs on CUDA: "few_rows", "swapped" or "scaled_mm"."""
    if m <= SMALL_ROWS:
        return "few_rows"
    if m <= SWAPPED_ROWS or (m <= SWAPPED_NARROW_ROWS and n <= k):
        return "swapped"
    return "scaled_mm"


@torch.library.custom_op("tandem::fp8_scaled_mm", mutates_args=())
def scaled_mm(
    x: torch.Tensor,  # [M, K] e4m3
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [1, N] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """-> [M, N] = (x @ weight^T) * x_scale * weight_scale in `out_dtype`. An opaque op, so that the
    choice of kernel follows each call's row count, also in a graph compiled for any token count."""
    kernel = gemm_kernel(x.shape[0], *weight.shape) if x.is_cuda else "scaled_mm"
    if kernel == "few_rows":
        from .triton_fp8_gemm import fp8_gemm

        return fp8_gemm(x, x_scale, weight, weight_scale, out_dtype)
    if kernel == "swapped":
        from .triton_fp8_gemm_swapped import fp8_gemm_swapped

        return fp8_gemm_swapped(x, x_scale, weight, weight_scale, out_dtype)
    # weight.t(): the column-major [K, N] operand the scaled GEMM takes
    return torch._scaled_mm(x, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=out_dtype)


@scaled_mm.register_fake
def _(
    x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in e4m3 ([out, in], a float32 scale per output row) and x quantized per
    token; the output in the input's dtype."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"Fp8Linear: weight must be 2-D {FP8}, got {weight.dtype} {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        if weight_scale.numel() != out_features:
            raise ValueError(f"Fp8Linear: {weight_scale.numel()} weight scales for {out_features} outputs")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        # [1, out]: the layout _scaled_mm takes for per-column scales of its second operand
        scale = weight_scale.detach().float().reshape(1, out_features).contiguous()
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weights in e4m3, each output channel scaled to its largest magnitude."""
        weight, scale = quantize_rows(linear.weight.detach())
        return cls(weight, scale, linear.bias)

    @classmethod
    def concat(cls, layers: list[Fp8Linear]) -> Fp8Linear:
        """Layers of one input as one (the outputs stacked): per-channel scales stack with them."""
        bias = None
        if layers[0].bias is not None:
            bias = torch.cat([layer.bias for layer in layers])
        return cls(
            torch.cat([layer.weight for layer in layers]),
            torch.cat([layer.weight_scale.flatten() for layer in layers]),
            bias,
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights as `dtype` ([out, in]): what the layer multiplies by, for references."""
        return (self.weight.float() * self.weight_scale.t()).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = self.of_quantized(*quantize_rows(rows), x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def of_quantized(self, xq: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The layer over rows already quantized (e4m3 [M, in], float32 scales [M, 1]) -> [M, out]."""
        y = scaled_mm(xq, x_scale, self.weight, self.weight_scale, out_dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


@torch.no_grad()
def quantize_linears(model: nn.Module) -> int:
    """Every nn.Linear of `model` in FP8, in place, but the output embedding (lm_head, as published
    FP8 checkpoints keep it) and layers whose sizes the FP8 GEMM cannot take -> layers quantized."""
    keep = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    done = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not keep and fits_fp8_gemm(child):
                setattr(module, name, Fp8Linear.quantize(child))
                done += 1
    return done


@torch.no_grad()
def compile_gemm_variants(model: nn.Module) -> int:
    """Compile, before serving, every variant of the Triton GEMMs a step of `model` may launch: each
    FP8 layer shape on CUDA at every row count a Triton kernel takes (`gemm_kernel`; Triton compiles
    again per block of rows and per class of the row count, and an eager mixed step may bring any
    of them). -> products run."""
    layers: dict[tuple[int, int], Fp8Linear] = {}
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module.weight.is_cuda:
            layers.setdefault((module.out_features, module.in_features), module)
    dtype = compute_dtype(model)
    runs = 0
    for (n, k), layer in layers.items():
        for rows in range(1, SWAPPED_NARROW_ROWS + 1):
            if gemm_kernel(rows, n, k) == "scaled_mm":
                continue
            x = torch.zeros(rows, k, dtype=FP8, device=layer.weight.device)
            scaled_mm(x, torch.ones(rows, 1, device=x.device), layer.weight, layer.weight_scale, dtype)
            runs += 1
    return runs


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its input embedding's (FP8 layers hold e4m3 weights)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        return embeddings.weight.dtype
    return next(p.dtype for p in model.parameters() if p.dtype != FP8)


def quantization_of(model: nn.Module) -> str:
    """"fp8" where any linear layer of `model` runs in FP8, else "none"."""
    return "fp8" if any(isinstance(m, Fp8Linear) for m in model.modules()) else "none"
