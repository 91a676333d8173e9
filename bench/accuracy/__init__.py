"""`tandem bench accuracy`: what FP8 weights (W8A8) and an FP8 KV cache cost in accuracy, measured
through the engine against the same model in bf16: perplexity of a fixed corpus and greedy
agreement over fixed chat prompts (benchmark.py). The corpus and the prompts ship beside this
package (data.py); variants.py builds each variant's engine core, perplexity.py and agreement.py
measure it.
"""
