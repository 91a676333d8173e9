"""Whether the FP8 KV cache's scales set what it costs (docs/quantization.md, "Accuracy").

SmolLM2-135M-Instruct (the embedded model) in bf16, its attention reading K and V rounded to e4m3
as an FP8 cache stores them, with: every scale 1.0 (the engine's default), a scale per layer fitted
to that layer's largest K and V over the same text (amax / 448), and a scale per KV head fitted to
each window. Perplexity of the accuracy benchmark's corpus (bench/accuracy/corpus.txt) in windows
of 1,024 tokens through transformers' own forward (every window's K/V rounded, as a cache would
give them back). e4m3 keeps 3 mantissa bits whatever the scale, so a scale moves only the values
that would fall below e4m3's normal range or above 448. CPU: `python scripts/fp8_kv_scales.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tandem.bench.accuracy.data import corpus_text
from tandem.bench.accuracy.perplexity import through_model
from tandem.service.engine.ops.kv_quant import round_trip
from tandem.service.models.loader import load_model

WINDOW = 1024
FP8_MAX = 448.0
Scales = Callable[[int, torch.Tensor, str], torch.Tensor | None]  # (layer, K or V, "k"/"v") -> scale


class KvRounding:
    """An attention function that rounds K and V to e4m3 at the scales `scales` picks (None: as is),
    and records each layer's largest K and V."""

    def __init__(self) -> None:
        self.scales: Scales = lambda layer, x, which: None
        self.amax: dict[tuple[int, str], float] = {}

    def __call__(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None, **kw: object) -> tuple[torch.Tensor, None]:
        layer = module.layer_idx
        rounded = []
        for which, x in (("k", k), ("v", v)):
            key = (layer, which)
            self.amax[key] = max(self.amax.get(key, 0.0), x.abs().max().item())
            scale = self.scales(layer, x, which)
            rounded.append(x if scale is None else round_trip(x, scale))
        return sdpa_attention_forward(module, q, rounded[0], rounded[1], mask, **kw)


def main() -> None:
    loaded = load_model(None, None, torch.device("cpu"), dtype="bfloat16")
    model = loaded.model
    ids = loaded.tokenizer(corpus_text()).input_ids
    rounding = KvRounding()
    AttentionInterface.register("kv_rounding", rounding)
    model.set_attn_implementation("kv_rounding")
    # K/V as they are; records every layer's largest K and V
    base = through_model(model, ids, WINDOW).perplexity
    amax = dict(rounding.amax)
    variants: dict[str, Scales] = {
        "every scale 1.0": lambda layer, x, which: torch.tensor(1.0),
        "a scale per layer (amax / 448)": lambda layer, x, which: torch.tensor(amax[layer, which] / FP8_MAX),
        "a scale per KV head and window": lambda layer, x, which: (
            x.abs().amax(dim=(0, 2, 3), keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        ),
    }
    print(f"{len(ids)} tokens; bf16 K/V: perplexity {base:.3f}")
    largest = max(amax.values())
    print(f"largest |K| or |V| in any layer: {largest:.2f} (e4m3's largest: {FP8_MAX:.0f})")
    for name, scales in variants.items():
        rounding.scales = scales
        ppl = through_model(model, ids, WINDOW).perplexity
        print(f"FP8 K/V, {name}: perplexity {ppl:.3f}, {100 * (ppl / base - 1):+.2f}%")


if __name__ == "__main__":
    main()
