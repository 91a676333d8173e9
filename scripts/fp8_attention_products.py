"""What the decode kernel's matrix products with e4m3 operands would cost in accuracy
(docs/quantization.md, "Why 32 x 1,024 misses 1.7x").

Over an FP8 cache the decode kernel converts every e4m3 element of K and V to the query's dtype
before its two matrix products; taken with e4m3 operands the tiles would go in as stored, but the
other operands must be e4m3 too: the query (scaled per token and head to e4m3's range) for
Q.K^T, and the softmax's probabilities (exp(s - max) <= 1, times 448) for P.V, the sum that
normalises them kept in float32. This script computes attention that way on the embedded
SmolLM2-135M-Instruct in bf16 through transformers' forward, every query of every window as a
decode step's (perplexity of the accuracy benchmark's corpus in windows of 1,024 tokens), against
the same attention with the products in bf16 as the engine's kernel takes them, and with them in
float16 (K and V widened from e4m3, which float16 holds exactly; the query and the probabilities
rounded to float16). K and V are rounded to e4m3 at scale 1.0 (the engine's default) in every
variant but the first. CPU:
`python scripts/fp8_attention_products.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from tandem.bench.accuracy.data import corpus_text
from tandem.bench.accuracy.perplexity import through_model
from tandem.service.engine.ops.e4m3 import FP8, FP8_MAX
from tandem.service.engine.ops.kv_quant import round_trip
from tandem.service.models.loader import load_model

WINDOW = 1024


@dataclass
class Products:
    """How one attention call rounds its operands: K/V to e4m3 (as an FP8 cache stores them), the
    query to e4m3 per token and head, the probabilities to e4m3 (else each to `wide`: bf16 as the
    engine's kernel takes them, or float16)."""

    kv8: bool = True
    q8: bool = False
    p8: bool = False
    wide: torch.dtype = torch.bfloat16


def e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3, each row (last dimension) scaled to e4m3's range, back in float32."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x / scale).to(FP8).float() * scale


class Fp8ProductsAttention:
    """An attention function (windows without a past: causal over the window) computing Q.K^T and
    P.V with the operands `products` names rounded."""

    def __init__(self) -> None:
        self.products = Products(kv8=False)

    def __call__(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None, scaling: float | None = None, **kw: object
                 ) -> tuple[torch.Tensor, None]:
        how = self.products
        if how.kv8:
            k, v = round_trip(k, torch.tensor(1.0)), round_trip(v, torch.tensor(1.0))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
        q = e4m3_rows(q.float()) if how.q8 else q.to(how.wide).float()
        scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
        length = scores.shape[-1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        total = p.sum(dim=-1, keepdim=True)  # float32, from the unrounded probabilities
        p = (p * FP8_MAX).to(FP8).float() / FP8_MAX if how.p8 else p.to(how.wide).float()
        out = (p @ v) / total
        return out.to(module.o_proj.weight.dtype).transpose(1, 2).contiguous(), None


def main() -> None:
    loaded = load_model(None, None, torch.device("cpu"), dtype="bfloat16")
    model = loaded.model
    ids = loaded.tokenizer(corpus_text()).input_ids
    attention = Fp8ProductsAttention()
    AttentionInterface.register("fp8_products", attention)
    model.set_attn_implementation("fp8_products")
    variants = {
        "bf16 K/V, products in bf16": Products(kv8=False),
        "e4m3 K/V, products in bf16 (the engine's kernel)": Products(),
        "e4m3 K/V, e4m3 query (Q.K^T in e4m3)": Products(q8=True),
        "e4m3 K/V, e4m3 probabilities (P.V in e4m3)": Products(p8=True),
        "e4m3 K/V, e4m3 query and probabilities (both)": Products(q8=True, p8=True),
        "e4m3 K/V, products in float16": Products(wide=torch.float16),
    }
    print(f"{len(ids)} tokens in windows of {WINDOW}")
    base = None
    for name, products in variants.items():
        attention.products = products
        ppl = through_model(model, ids, WINDOW).perplexity
        base = base or ppl
        print(f"{name}: perplexity {ppl:.3f}, {100 * (ppl / base - 1):+.2f}% of the first", flush=True)


if __name__ == "__main__":
    main()
