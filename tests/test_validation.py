"""Request validation: every rule, with the field named in the message."""

from __future__ import annotations

import math

import pytest

from tandem.service.contract import ErrorKind, Limits, RequestError
from tandem.service.server.validation import resolve_params, validate_prompt

LIMITS = Limits(
    vocab_size=100, max_model_len=64, default_max_tokens=16, max_stop_strings=2, max_stop_string_chars=8
)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 101}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_tokens": 55}, "max_tokens"),  # 10 prompt + 55 > 64
        ({"stop": ["a", "b", "c"]}, "stop strings"),
        ({"stop": [""]}, "stop strings"),
        ({"stop": ["x" * 9]}, "stop string"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_parameters_are_invalid_argument(kwargs, field):
    with pytest.raises(RequestError) as exc:
        resolve_params(LIMITS, 10, **kwargs)
    assert exc.value.kind is ErrorKind.INVALID_ARGUMENT
    assert field in exc.value.message
    assert exc.value.param == next(iter(kwargs))  # the field OpenAI's error body names


def test_top_p_zero_is_greedy():
    """OpenAI reads top_p 0 as the likeliest token alone: greedy, whatever the temperature."""
    p = resolve_params(LIMITS, 10, temperature=0.8, top_p=0.0, seed=3)
    assert (p.temperature, p.top_p, p.greedy) == (0.0, 1.0, True)


def test_a_prompt_and_max_tokens_past_the_context_are_context_length_exceeded():
    """Too many new tokens after a prompt that fits: the error names max_tokens and what fits."""
    with pytest.raises(RequestError) as exc:
        resolve_params(LIMITS, 60, max_tokens=5)
    assert (exc.value.param, exc.value.code) == ("max_tokens", "context_length_exceeded")
    assert "at most 4 new tokens fit" in exc.value.message


def test_defaults_fill_in_and_fit_the_context():
    p = resolve_params(LIMITS, 10)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 1.0, 0, 16)
    assert resolve_params(LIMITS, 60).max_tokens == 4  # default shrinks to what fits
    assert resolve_params(LIMITS, 10, top_logprobs=3).logprobs


@pytest.mark.parametrize(
    "prompt, words",
    [([], "empty"), ([5, -1], "token id -1"), ([100], "token id 100"), (list(range(64)), "context length")],
)
def test_bad_prompts(prompt, words):
    with pytest.raises(RequestError) as exc:
        validate_prompt(prompt, LIMITS)
    assert words in exc.value.message
    assert exc.value.param == "prompt"


def test_a_prompt_past_the_context_is_context_length_exceeded_on_its_field():
    """OpenAI's code, on the field that holds the prompt; no word of max_tokens or negative room."""
    with pytest.raises(RequestError) as exc:
        validate_prompt(list(range(70)), LIMITS, "messages")
    err = exc.value
    assert (err.param, err.code) == ("messages", "context_length_exceeded")
    assert "70" in err.message and "64" in err.message
    assert "max_tokens" not in err.message and "-" not in err.message
