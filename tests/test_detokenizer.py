"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tandem.service.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tok(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


TEXTS = ["Hello, world! Ünïcödé ✓ — 日本語のテキスト 🎉🎉", "  two  spaces\nand lines\n\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_rebuild_the_text(tok, text):
    prompt = tok.encode("Say:")
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add([t]) for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never half a character


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
