"""`tandem bench accuracy`: perplexity through the engine equals the model's own, greedy agreement
counts what it says, and the command runs end to end (--smoke) with sane numbers."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.bench.accuracy import perplexity
from tandem.bench.accuracy.agreement import agreement, common_prefix
from tandem.bench.accuracy.variants import VARIANTS, build
from tandem.bench.engine.variants import build_model
from tandem.service.engine.config import EngineConfig


def test_agreement_counts_identical_answers_first_tokens_and_common_prefixes():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    answers = [[1, 2, 3, 4], [5, 6, 0, 0], [0, 9, 9, 9]]
    assert [common_prefix(a, r) for a, r in zip(answers, reference, strict=True)] == [4, 2, 0]
    got = agreement(answers, reference)
    assert got == {"prompts": 3, "new_tokens": 4, "identical": round(1 / 3, 4),
                   "first_token": round(2 / 3, 4), "mean_common_prefix": 2.0}
    assert agreement(reference, reference)["identical"] == 1.0


def test_windows_cover_the_tokens_and_skip_a_tail_with_nothing_to_score():
    assert perplexity.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert perplexity.windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_engine_perplexity_equals_the_models_own_forward():
    """float32, windows prefilled in chunks of 16 (later chunks read the cache): the NLL the engine's
    rows give equals the one of transformers' plain forward over each whole window."""
    reference = build_model("tiny", torch.device("cpu"), torch.float32)
    twin = copy.deepcopy(reference)
    spec = EngineConfig(num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16, cuda_graphs=False)
    core = build(VARIANTS["fp32"], lambda dtype: twin.to(dtype), spec)
    ids = torch.randint(0, 512, (101,), generator=torch.Generator().manual_seed(0)).tolist()
    got = perplexity.measure(core, ids, window=48)  # windows 48, 48, 5: chunks of 16, 16, 16 and 5
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in perplexity.windows(ids, 48):
            logits = reference(torch.tensor([w])).logits[0, :-1].float()
            nll -= float(torch.log_softmax(logits, -1).gather(1, torch.tensor(w[1:])[:, None]).sum())
            count += len(w) - 1
    assert (got.tokens, got.windows) == (count, 3) == (98, 3)
    assert got.nll == pytest.approx(nll, rel=1e-4)
    assert not core.has_work and core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks


def test_tandem_bench_accuracy_smoke(tmp_path):
    out = tmp_path / "accuracy.json"
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), "bench", "accuracy", "--smoke", "--variants", "fp32,bf16,w8a8,kv8", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| variant | perplexity |" in proc.stdout and "| bf16 |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "accuracy" and result["smoke"] is True
    assert result["command"].startswith("tandem bench accuracy --smoke")
    assert out.with_suffix(".md").read_text().startswith("| variant |")
    variants, new = result["variants"], result["prompts"]["new_tokens"]
    assert list(variants) == ["bf16", "fp32", "w8a8", "kv8"]  # the baseline first
    bf16, w8a8 = variants["bf16"], variants["w8a8"]
    for v in (bf16, variants["fp32"], w8a8):
        ppl = v["perplexity"]
        assert v["available"] and math.isfinite(ppl["perplexity"]) and ppl["perplexity"] > 1
        assert ppl["tokens"] == result["corpus"]["tokens"] - ppl["windows"]
        assert len(v["answers"]) == result["prompts"]["count"] and all(len(a) == new for a in v["answers"])
    assert bf16["ratio_to_bf16"] == 1.0
    assert bf16["greedy"] == {"prompts": result["prompts"]["count"], "new_tokens": new, "identical": 1.0,
                              "first_token": 1.0, "mean_common_prefix": float(new)}
    # W8A8 computes something else than bf16: its NLL differs, and the target is judged
    assert w8a8["perplexity"]["nll_per_token"] != bf16["perplexity"]["nll_per_token"]
    assert w8a8["target_ratio"] == 1.03 and w8a8["target_met"] == (w8a8["ratio_to_bf16"] <= 1.03)
    kv8 = variants["kv8"]
    if not kv8["available"]:  # a build without the FP8 cache says so, and gives no number
        assert "fp8 KV not available in this build" in kv8["why"] and "perplexity" not in kv8
    else:
        assert kv8["target_ratio"] == 1.01 and math.isfinite(kv8["perplexity"]["perplexity"])
