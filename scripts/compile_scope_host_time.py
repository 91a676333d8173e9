"""What each compile scope costs the host per forward: a random Llama of negligible width (64), so the
time of a call is the host's (frame entries, guards, launches), compiled whole and by layer, at
2 and at 32 layers: the difference over 30 layers is the price of a layer.

    python scripts/compile_scope_host_time.py                # Inductor, batch 8 of one token
    python scripts/compile_scope_host_time.py --backend aot_eager --layers 2,16
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.service.engine.compile_scope import compile_forward


def forward_ms(scope: str, layers: int, backend: str, calls: int, rounds: int) -> float:
    """Best mean time of one forward over `rounds` rounds of `calls`, once compiled."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    forward = compile_forward(LlamaForCausalLM(config).eval(), scope, backend)
    ids = torch.randint(0, 256, (8, 1))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(5):  # compiles
            forward(input_ids=ids, use_cache=False)
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                forward(input_ids=ids, use_cache=False)
            best = min(best, (time.perf_counter() - start) / calls)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--layers", default="2,32", help="two layer counts, comma-separated")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    few, many = (int(n) for n in args.layers.split(","))
    for scope in ("model", "layer"):
        a, b = (forward_ms(scope, n, args.backend, args.calls, args.rounds) for n in (few, many))
        print(f"{scope}: {a:.2f} ms at {few} layers, {b:.2f} ms at {many}: "
              f"{1e3 * (b - a) / (many - few):.0f} us a layer", flush=True)


if __name__ == "__main__":
    main()
