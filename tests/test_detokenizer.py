"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tandem.service.server.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def fast_tok(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


class _PythonOnly:
    """The same tokenizer seen without its Rust backend: the detokenizer's generic path."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def decode(self, *args, **kwargs):
        return self._tok.decode(*args, **kwargs)

    def __getattr__(self, name):
        if name == "_tokenizer":
            raise AttributeError(name)
        return getattr(self._tok, name)


@pytest.fixture(scope="module", params=["decode_stream", "python"])
def tok(request, fast_tok):
    return fast_tok if request.param == "decode_stream" else _PythonOnly(fast_tok)


def test_both_paths_are_taken(fast_tok):
    assert IncrementalDetokenizer(fast_tok, [])._stream is not None
    assert IncrementalDetokenizer(_PythonOnly(fast_tok), [])._stream is None


TEXTS = ["Hello, world! Ünïcödé ✓ — 日本語のテキスト 🎉🎉", "  two  spaces\nand lines\n\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_rebuild_the_text(tok, text):
    prompt = tok.encode("Say:")
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add([t]) for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never half a character


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("every", [2, 3, 7])
def test_coalesced_deltas_rebuild_the_text(tok, text, every):
    """Tokens a stream sends together are decoded together: the same text, never half a character."""
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("Say:"))
    pieces = [d.add(ids[i : i + every]) for i in range(0, len(ids), every)]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_leading_space_after_the_prompt(tok):
    prompt = tok.encode("The capital of France is")
    ids = tok.encode(" Paris, of course.", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    assert "".join(d.add([t]) for t in ids) == " Paris, of course."


def test_special_tokens_are_not_text(tok):
    d = IncrementalDetokenizer(tok, [])
    ids = tok.encode("Paris.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(d.add([t]) for t in ids) == "Paris."


def test_stop_string_cuts_and_holds_back_partial_matches():
    m = StopStringMatcher(("STOP", "\n\n"))
    assert m.feed("abc ST") == ("abc", None)  # ' ST' could start 'STOP': held back
    assert m.feed("O") == (" ", None)
    assert m.feed("P and more") == ("", "STOP")  # nothing from the stop string on is emitted


def test_stop_string_across_many_small_deltas_and_flush():
    m = StopStringMatcher(("the end",))
    out = []
    for ch in "so this is not the en":
        text, hit = m.feed(ch)
        out.append(text)
        assert hit is None
    out.append(m.flush())
    assert "".join(out) == "so this is not the en"


def test_earliest_stop_string_wins():
    m = StopStringMatcher(("zz", "b"))
    assert m.feed("a b zz") == ("a ", "b")


def test_no_stop_strings_emits_everything_at_once():
    m = StopStringMatcher(())
    assert m.feed("hello") == ("hello", None)
