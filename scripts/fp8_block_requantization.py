"""What running a block-wise FP8 checkpoint per channel costs (docs/quantization.md, "FP8 checkpoints").

SmolLM2-135M-Instruct (the embedded model) in bf16, its linear layers quantized to e4m3 in 128 x 128
blocks as block-wise checkpoints are published, then: the blocks' dequantized weights (what the
checkpoint means), the same requantized per output channel (what Tandem runs), and per-channel FP8
straight from bf16. Perplexity over a fixed local text, next-token agreement, weight error.
Activations are quantized per token in every FP8 variant. CPU: `python scripts/fp8_block_requantization.py`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.service.engine.ops.fp8_linear import FP8, FP8_MAX, Fp8Linear, quantize_linears, quantize_rows
from tandem.service.models.default_model import default_gguf_path
from tandem.service.models.loader import convert_gguf, default_cache_dir

BLOCK = 128
TOKENS = 1024
TEXT = ("docs/architecture.md", "docs/autoscaling.md")


class BlockReference(torch.nn.Module):
    """A block-wise checkpoint's layer as published: its dequantized weights, activations per token."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x)
        return (xq.float() * xs) @ self.weight.t()


def block_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """`weight` quantized to e4m3 with a scale per BLOCK x BLOCK block, and back."""
    rows, columns = weight.shape
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-columns // BLOCK) * BLOCK)
    padded[:rows, :columns] = weight.abs()
    scale = padded.reshape(padded.shape[0] // BLOCK, BLOCK, -1, BLOCK).amax(dim=(1, 3)) / FP8_MAX
    full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :columns]
    return (weight / full).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * full


def main() -> None:
    path = convert_gguf(default_gguf_path(), default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().eval()
    text = "".join(Path(name).read_text() for name in TEXT)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :TOKENS]
    block, requantized, direct = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    quantize_linears(direct)
    errors = []
    for name, module in list(base.named_modules()):
        if isinstance(module, torch.nn.Linear) and module is not base.lm_head:
            published = block_dequantized(module.weight.detach().float())
            weight, scale = quantize_rows(published)
            errors.append(((weight.float() * scale - published).norm() / published.norm()).item())
            parent, _, child = name.rpartition(".")
            setattr(block.get_submodule(parent), child, BlockReference(published))
            setattr(requantized.get_submodule(parent), child, Fp8Linear(weight, scale, module.bias))

    @torch.no_grad()
    def perplexity_and_argmax(model: torch.nn.Module) -> tuple[float, torch.Tensor]:
        out = model(input_ids=ids, labels=ids)
        return torch.exp(out.loss).item(), out.logits.argmax(-1)

    results = {
        "bf16": perplexity_and_argmax(base),
        "block-wise FP8 as published": perplexity_and_argmax(block),
        "block-wise FP8 requantized per channel": perplexity_and_argmax(requantized),
        "per-channel FP8 from bf16": perplexity_and_argmax(direct),
    }
    bf16 = results["bf16"][0]
    print(f"{ids.shape[1]} tokens of {', '.join(TEXT)}")
    for name, (perplexity, _) in results.items():
        print(f"{name:40s} perplexity {perplexity:8.4f}  {100 * (perplexity / bf16 - 1):+.1f}%")
    tokens = {name: argmax for name, (_, argmax) in results.items()}
    agree = (
        tokens["block-wise FP8 requantized per channel"] == tokens["block-wise FP8 as published"]
    ).float()
    print(f"next tokens: requantized = published at {agree.mean().item():.4f} of the positions")
    published_bf16 = (tokens["block-wise FP8 as published"] == tokens["bf16"]).float().mean().item()
    print(f"next tokens: published = bf16 at {published_bf16:.4f} of the positions")
    print(f"requantization's weight error: mean {sum(errors) / len(errors):.4f}, max {max(errors):.4f}")


if __name__ == "__main__":
    main()
