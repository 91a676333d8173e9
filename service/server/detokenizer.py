"""Incremental detokenization and stop strings, on the host, per request."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so leading spaces come out right


def _decode_stream(
    tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool
) -> DecodeStream | None:
    """The tokenizers library's own incremental decoder, where the tokenizer has that backend."""
    if not isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer):
        return None
    try:
        return DecodeStream(ids=list(prompt_ids[-_PROMPT_CONTEXT:]), skip_special_tokens=skip_special_tokens)
    except TypeError:  # a tokenizers release whose DecodeStream takes no prompt context
        return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; never emits half a UTF-8 character.

    With a fast (Rust) tokenizer this is its `DecodeStream`, one call per delta whatever its length;
    otherwise two decodes of the last few tokens per delta, in Python. Special tokens are left out
    unless `skip_special_tokens` is false.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = _decode_stream(tokenizer, prompt_ids, skip_special_tokens)
        self.tokens = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, ids: list[int]) -> str:
        if self._stream is not None:
            return (self._stream.step(self.tokenizer._tokenizer, ids) or "") if ids else ""
        self.tokens.extend(ids)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""


class StopStringMatcher:
    """Finds the first stop string in streamed text; holds back text that could start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit now, the stop string if one matched)."""
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        hit, cut = None, len(self.text)
        for stop in self.stops:
            i = self.text.find(stop, start)
            if i != -1 and i < cut:
                hit, cut = stop, i
        if hit is None:
            cut = max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : cut]
        self.emitted = cut
        return out, hit

    def flush(self) -> str:
        """At the end of generation: whatever was held back."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
