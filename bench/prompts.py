"""The requests the benchmarks send: prompts of random token ids, how many new tokens each asks for,
and (in request-rate mode) when each arrives.

- `fixed`: every prompt `prompt` tokens, every answer `new` tokens.
- `mixed`: a ShareGPT-like spread of lengths: log-normal prompt and answer lengths (long tails, most
  requests short), clipped to a range and to the context length. Means and ranges by default as
  measured on chat traffic of that kind: prompts 16-2,048 tokens with a mean near 580, answers
  8-1,024 with a mean near 250.

A `prefix` (a system prompt, `system_prompt`) starts every prompt of a set of requests, then its
own tokens as the dataset says: the workload of prefix caching.

A `salt` draws other prompt tokens of the same lengths: requests of different salts share no
prompt prefix (a prompt's first cache block differs, unless 16 random ids repeat), so a prefix
cache warmed by one set of requests holds nothing of another's. `tandem bench serve` gives each
pass its own salt (docs in serve/benchmark.py).

Every request runs to its `max_tokens` (ignore_eos), so the server and the engine alone do the same
work whatever the random weights make of the prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    at: float | None = None  # request-rate mode: seconds after the level starts; None = at once


@dataclass(frozen=True)
class Lengths:
    """A log-normal length distribution clipped to [low, high]."""

    mean: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma**2 / 2  # so that the unclipped mean is `mean`
        return max(self.low, min(self.high, round(rng.lognormvariate(mu, self.sigma))))


MIXED_PROMPT = Lengths(mean=580, sigma=1.0, low=16, high=2048)
MIXED_OUTPUT = Lengths(mean=250, sigma=1.0, low=8, high=1024)
PREFIX_SEED = 0x5EED


def system_prompt(length: int, vocab: int, salt: str = "") -> list[int]:
    """`length` random ids that every prompt of a set of requests starts with; another per salt."""
    rng = random.Random(f"{PREFIX_SEED}/{salt}" if salt else PREFIX_SEED)
    return [rng.randrange(vocab) for _ in range(length)]


def jobs(
    dataset: str,
    count: int,
    vocab: int,
    max_model_len: int,
    seed: int,
    prompt: int = 128,
    new: int = 256,
    prefix: Sequence[int] = (),
    salt: str = "",
) -> list[Job]:
    """`count` requests; a prompt and its answer always fit the context length. `seed` draws the
    lengths (and, unsalted, the token ids with them); `salt`: the token ids from a stream of their
    own, so every salt of one seed gives the same lengths and other tokens."""
    rng = random.Random(seed)
    ids = random.Random(f"{seed}/{salt}") if salt else rng
    prefix = list(prefix)
    out = []
    for _ in range(count):
        if dataset == "fixed":
            n_prompt, n_new = prompt, new
        elif dataset == "mixed":
            n_prompt, n_new = MIXED_PROMPT.draw(rng), MIXED_OUTPUT.draw(rng)
        else:
            raise ValueError(f"unknown dataset {dataset!r}: fixed or mixed")
        n_prompt = max(1, min(n_prompt, max_model_len - 2 - len(prefix)))
        n_new = max(1, min(n_new, max_model_len - len(prefix) - n_prompt))
        out.append(Job(prefix + [ids.randrange(vocab) for _ in range(n_prompt)], n_new))
    return out


def poisson_arrivals(jobs_: list[Job], rate: float, seed: int) -> list[Job]:
    """The same requests arriving as a Poisson process of `rate` requests per second."""
    rng = random.Random(seed + 1)
    t = 0.0
    for job in jobs_:
        job.at = t
        t += rng.expovariate(rate)
    return jobs_


def describe(jobs_: list[Job]) -> dict:
    prompts = [len(j.prompt_ids) for j in jobs_]
    news = [j.max_tokens for j in jobs_]
    return {
        "requests": len(jobs_),
        "prompt_tokens": {
            "mean": round(sum(prompts) / len(prompts), 1),
            "min": min(prompts),
            "max": max(prompts),
        },
        "new_tokens": {"mean": round(sum(news) / len(news), 1), "min": min(news), "max": max(news)},
    }


def as_dicts(jobs_: list[Job]) -> list[dict]:
    return [asdict(j) for j in jobs_]


# -- the engine's workloads: every request submitted at once -------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    new: list[int]

    @property
    def live_tokens(self) -> int:
        return sum(len(p) + n for p, n in zip(self.prompts, self.new, strict=True))


def mixed(count: int, vocab: int, max_len: int, seed: int) -> Workload:
    """`count` requests of the mixed dataset (the same for a seed everywhere it runs)."""
    js = jobs("mixed", count, vocab, max_len, seed)
    return Workload([j.prompt_ids for j in js], [j.max_tokens for j in js])


def shared_prefixes(
    prefixes: int, per_prefix: int, prefix_len: int, vocab: int, new: int, seed: int
) -> Workload:
    """`prefixes` system prompts, each before `per_prefix` distinct 64-token questions, shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts = [s + [rng.randrange(vocab) for _ in range(64)] for s in systems for _ in range(per_prefix)]
    rng.shuffle(prompts)
    return Workload(prompts, [new] * len(prompts))


def fixed(count: int, prompt: int, new: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return Workload([[rng.randrange(vocab) for _ in range(prompt)] for _ in range(count)], [new] * count)
