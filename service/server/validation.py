"""Checks a request at admission, before it reaches the engine; every failure is a precise
RequestError naming the field it is about. A prompt that cannot fit the context, or a prompt and
`max_tokens` that together exceed it, is `context_length_exceeded` (OpenAI's code)."""

from __future__ import annotations

import math

from .. import structured_output as grammars
from ..contract import Limits, SamplingParams, StructuredOutput, invalid

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

MAX_TEMPERATURE = 100.0
MAX_TOP_LOGPROBS = 20


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise invalid(f"{name} must be a finite number, got {value}", name)


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """`name`: the request field that holds them."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(f"{name} contains token id {bad}; valid ids are 0..{vocab_size - 1}", name)


def validate_prompt(prompt_ids: list[int], limits: Limits, param: str = "prompt") -> None:
    """`param`: the request field that holds the prompt (OpenAI's chat: "messages")."""
    if not prompt_ids:
        raise invalid("prompt is empty", param)
    check_token_ids("prompt", prompt_ids, limits.vocab_size)
    if len(prompt_ids) >= limits.max_model_len:
        raise invalid(
            f"the model's context length is {limits.max_model_len} tokens, and the prompt has "
            f"{len(prompt_ids)}: it must leave room for at least one new token; shorten the prompt",
            param,
            CONTEXT_LENGTH_EXCEEDED,
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
    prompt_logprobs: int | None = None,
    structured_output: StructuredOutput | None = None,
    structured_output_param: str = "structured_output",
) -> SamplingParams:
    """Validate raw request fields (None = not given) and fill defaults, for a prompt of `prompt_len`
    tokens that fits the context (validate_prompt). `top_p` 0 keeps only the likeliest token: greedy.
    `structured_output`: the constraint asked for, by the request field `structured_output_param`."""
    room = limits.max_model_len - prompt_len
    if temperature is not None:
        _finite("temperature", temperature)
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            most = MAX_TEMPERATURE
            raise invalid(f"temperature must be in [0, {most:g}], got {temperature}", "temperature")
    if top_p is not None:
        _finite("top_p", top_p)
        if not 0.0 <= top_p <= 1.0:
            raise invalid(f"top_p must be in [0, 1], got {top_p}", "top_p")
        if top_p == 0.0:  # the nucleus of the likeliest token alone, as OpenAI reads it
            temperature, top_p = 0.0, 1.0
    if top_k is not None and not 0 <= top_k <= limits.vocab_size:
        raise invalid(f"top_k must be in [0, {limits.vocab_size}] (0 = off), got {top_k}", "top_k")
    if seed is not None and not 0 <= seed < 2**63:
        raise invalid(f"seed must be in [0, 2^63), got {seed}", "seed")
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room)
    elif max_tokens <= 0:
        raise invalid(f"max_tokens must be positive, got {max_tokens}", "max_tokens")
    elif max_tokens > room:
        raise invalid(
            f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceeds the model's context length "
            f"of {limits.max_model_len} tokens; at most {room} new tokens fit after this prompt",
            "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
    if len(stop) > limits.max_stop_strings:
        most = limits.max_stop_strings
        raise invalid(f"{len(stop)} stop strings given; at most {most} are allowed", "stop")
    for s in stop:
        if not s:
            raise invalid("stop strings must not be empty", "stop")
        if len(s) > limits.max_stop_string_chars:
            most = limits.max_stop_string_chars
            raise invalid(f"a stop string has {len(s)} characters; at most {most}", "stop")
    check_token_ids("stop_token_ids", list(stop_token_ids), limits.vocab_size)
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}", "top_logprobs")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        most = MAX_TOP_LOGPROBS
        raise invalid(f"prompt_logprobs must be in [0, {most}], got {prompt_logprobs}", "prompt_logprobs")
    if structured_output is not None:  # never reaches the engine unless it is a grammar
        grammars.check(structured_output, structured_output_param)
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
        prompt_logprobs=prompt_logprobs,
        structured_output=structured_output,
    )
