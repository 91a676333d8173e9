"""Checks a request before it reaches the engine; every failure is a precise RequestError."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import invalid
from .sampling_params import SamplingParams

MAX_TEMPERATURE = 100.0
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    default_max_tokens: int
    max_stop_strings: int
    max_stop_string_chars: int


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise invalid(f"{name} must be a finite number, got {value}")


def _token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(f"{name} contains token id {bad}; valid ids are 0..{vocab_size - 1}")


def validate_prompt(prompt_ids: list[int], limits: Limits) -> None:
    if not prompt_ids:
        raise invalid("prompt is empty")
    _token_ids("prompt", prompt_ids, limits.vocab_size)
    if len(prompt_ids) >= limits.max_model_len:
        raise invalid(
            f"prompt has {len(prompt_ids)} tokens; the context length is {limits.max_model_len}, "
            "which must leave room for at least one new token"
        )


def resolve_params(
    limits: Limits,
    prompt_len: int,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    max_tokens: int | None = None,
    stop: list[str] | tuple[str, ...] = (),
    stop_token_ids: list[int] | tuple[int, ...] = (),
    ignore_eos: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> SamplingParams:
    """Validate raw request fields (None = not given) and fill defaults."""
    room = limits.max_model_len - prompt_len
    if temperature is not None:
        _finite("temperature", temperature)
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise invalid(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if top_p is not None:
        _finite("top_p", top_p)
        if not 0.0 < top_p <= 1.0:
            raise invalid(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and not 0 <= top_k <= limits.vocab_size:
        raise invalid(f"top_k must be in [0, {limits.vocab_size}] (0 = off), got {top_k}")
    if seed is not None and not 0 <= seed < 2**63:
        raise invalid(f"seed must be in [0, 2^63), got {seed}")
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room)
    elif max_tokens <= 0:
        raise invalid(f"max_tokens must be positive, got {max_tokens}")
    elif max_tokens > room:
        raise invalid(
            f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceeds the context length "
            f"{limits.max_model_len}; at most {room} new tokens fit"
        )
    if len(stop) > limits.max_stop_strings:
        raise invalid(f"{len(stop)} stop strings given; at most {limits.max_stop_strings} are allowed")
    for s in stop:
        if not s:
            raise invalid("stop strings must not be empty")
        if len(s) > limits.max_stop_string_chars:
            raise invalid(f"a stop string has {len(s)} characters; at most {limits.max_stop_string_chars}")
    _token_ids("stop_token_ids", list(stop_token_ids), limits.vocab_size)
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    return SamplingParams(
        temperature=float(temperature or 0.0),
        top_p=float(top_p if top_p is not None else 1.0),
        top_k=int(top_k or 0),
        seed=seed,
        max_tokens=max_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(int(t) for t in stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
    )
