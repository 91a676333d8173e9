"""The requests `tandem bench soak` sends: a seeded plan, so that a run can be repeated exactly.

Each request picks an API kind (native Generate / GenerateStream, KServe ModelInfer /
ModelStreamInfer), a text prompt of a log-normal number of words, a log-normal max_tokens, greedy or
sampled decoding, and whether the soak cancels it (`cancel_fraction` of them: a client cancel after a
few chunks on streams, a short client deadline, or on KServe its `timeout` parameter).

A share of the requests are probes: a few fixed prompts sent again and again on every kind, greedy or
seeded, whose answers must be identical across kinds and repeats. Probes never ignore EOS (KServe
cannot), so every kind stops where the others do.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from tandem.bench.prompts import Lengths

KINDS = ("native_unary", "native_stream", "kserve_unary", "kserve_stream")
STREAMING = {"native_stream", "kserve_stream"}

# common English words: prompts tokenize the way text does (about 1.3 tokens a word)
WORDS = (
    "the of and to in is that it was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now "
    "find long down day did get come made may part over new sound take only little work know place "
    "year live me back give most very after thing our just name good sentence man think say great "
    "where help through much before line right too mean old any same tell boy follow came want show "
    "also around form three small set put end does another well large must big even such because turn"
).split()


@dataclass(frozen=True)
class Mix:
    """The shape of a soak's requests."""

    prompt_words: Lengths = Lengths(mean=60, sigma=1.1, low=1, high=900)
    max_tokens: Lengths = Lengths(mean=40, sigma=1.0, low=1, high=256)
    cancel_fraction: float = 0.10
    probe_fraction: float = 0.15
    probes: int = 8  # distinct probe prompts; half greedy, half seeded sampling (all greedy without sampling)
    probe_max_tokens: tuple[int, int] = (8, 48)
    sampled_fraction: float = 0.5  # of the other requests: temperature > 0 (the rest greedy); 0: none
    deadline_s: tuple[float, float] = (0.005, 2.0)  # a short client deadline, log-uniform
    max_cancel_chunks: int = 8  # streams: cancel after 0..this many chunks (0: right after the call)
    shared_call_fraction: float = 0.25  # KServe streams that carry one or two more requests


SMOKE_MIX = Mix(
    prompt_words=Lengths(mean=20, sigma=1.0, low=1, high=200),
    max_tokens=Lengths(mean=8, sigma=0.8, low=1, high=32),
    probes=4,
    probe_max_tokens=(4, 12),
    deadline_s=(0.005, 0.5),
    max_cancel_chunks=4,
)


@dataclass
class SoakRequest:
    index: int
    kind: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False  # native only
    exclude_input: bool = False  # KServe only: without it the output starts with the prompt
    probe: int | None = None  # which repeated prompt, None for the others
    cancel: str | None = None  # None, "chunks", "deadline" or "timeout_param" (KServe's `timeout`)
    cancel_after: int = 0  # "chunks": cancel after this many messages
    deadline_s: float | None = None  # "deadline" / "timeout_param"
    call: int | None = None  # KServe streams: the request whose ModelStreamInfer call carries this one


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def probe_prompts(mix: Mix, seed: int) -> list[tuple[str, int, float, int | None]]:
    """(prompt, max_tokens, temperature, seed) of each probe: a spread of prompt lengths."""
    rng = random.Random(seed * 7919 + 1)
    out = []
    for i in range(mix.probes):
        words = max(1, round(mix.prompt_words.high * (i + 1) / (mix.probes + 1) / 2))
        sampled = i % 2 == 1 and mix.sampled_fraction > 0
        out.append(
            (
                _text(rng, words),
                rng.randint(*mix.probe_max_tokens),
                1.0 if sampled else 0.0,
                1000 + i if sampled else None,
            )
        )
    return out


def plan(count: int, mix: Mix, seed: int, start: int = 0) -> list[SoakRequest]:
    """`count` requests, the same for the same seed. `start`: the first index (warm-up and run apart).

    Some KServe streams carry one or two more requests (`call`: the first one's index), as a client
    that multiplexes one ModelStreamInfer stream does; a cancel of that call is all of theirs."""
    rng = random.Random(seed)
    probes = probe_prompts(mix, seed)
    out: list[SoakRequest] = []
    lead, riders = None, 0
    for index in range(start, start + count):
        req = _request(rng, index, "kserve_stream" if riders else rng.choice(KINDS), mix, probes)
        if riders:
            riders -= 1
            req.call = lead.index
            if lead.cancel in ("chunks", "deadline"):  # the call's, not the request's
                req.cancel, req.cancel_after, req.deadline_s = lead.cancel, lead.cancel_after, lead.deadline_s
        else:
            if rng.random() < mix.cancel_fraction:
                _plan_cancel(req, rng, mix)
            if req.kind == "kserve_stream" and rng.random() < mix.shared_call_fraction:
                lead, riders = req, rng.randint(1, 2)
                if req.cancel == "timeout_param":  # an error response names no request: one per call
                    req.cancel, req.deadline_s = None, None
        out.append(req)
    return out


def _request(rng: random.Random, index: int, kind: str, mix: Mix, probes: list) -> SoakRequest:
    if probes and rng.random() < mix.probe_fraction:
        p = rng.randrange(len(probes))
        prompt, max_tokens, temperature, probe_seed = probes[p]
        req = SoakRequest(index, kind, prompt, max_tokens, temperature, probe_seed, probe=p)
    else:
        sampled = rng.random() < mix.sampled_fraction
        req = SoakRequest(
            index,
            kind,
            _text(rng, mix.prompt_words.draw(rng)),
            mix.max_tokens.draw(rng),
            temperature=round(rng.uniform(0.5, 1.2), 3) if sampled else 0.0,
            seed=rng.randrange(2**32) if sampled and rng.random() < 0.5 else None,
            ignore_eos=kind.startswith("native") and rng.random() < 0.5,
        )
    req.exclude_input = kind.startswith("kserve") and rng.random() < 0.5
    return req


def calls(requests: list[dict]) -> list[list[dict]]:
    """The requests grouped by the call that carries them, in order."""
    out: list[list[dict]] = []
    by_lead: dict[int, list[dict]] = {}
    for r in requests:
        if r["call"] is None:
            by_lead[r["index"]] = [r]
            out.append(by_lead[r["index"]])
        else:
            by_lead[r["call"]].append(r)
    return out


def _plan_cancel(req: SoakRequest, rng: random.Random, mix: Mix) -> None:
    ways = ["deadline"]
    if req.kind in STREAMING:
        ways += ["chunks", "chunks"]  # streams are cancelled mostly from the client
    if req.kind.startswith("kserve"):
        ways.append("timeout_param")
    req.cancel = rng.choice(ways)
    if req.cancel == "chunks":
        req.cancel_after = rng.randint(0, mix.max_cancel_chunks)
    else:
        req.deadline_s = round(_log_uniform(rng, *mix.deadline_s), 4)


def describe(requests: list[SoakRequest]) -> dict:
    """What the plan holds, for the report."""
    kinds = {k: sum(r.kind == k for r in requests) for k in KINDS}
    cancels: dict[str, int] = {}
    for r in requests:
        if r.cancel:
            cancels[r.cancel] = cancels.get(r.cancel, 0) + 1
    words = [len(r.prompt.split()) for r in requests]
    news = [r.max_tokens for r in requests]
    return {
        "requests": len(requests),
        "kinds": kinds,
        "cancelled_by_soak": cancels,
        "probes": sum(r.probe is not None for r in requests),
        "riding_a_shared_kserve_stream": sum(r.call is not None for r in requests),
        "greedy": sum(r.temperature == 0 for r in requests),
        "prompt_words": {"mean": round(sum(words) / len(words), 1), "min": min(words), "max": max(words)},
        "max_tokens": {"mean": round(sum(news) / len(news), 1), "min": min(news), "max": max(news)},
    }


def as_dicts(requests: list[SoakRequest]) -> list[dict]:
    return [asdict(r) for r in requests]
