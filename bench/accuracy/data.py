"""The fixed inputs of the accuracy benchmark, shipped beside this module so that every run scores
the same text and asks the same questions.

corpus.txt: about 2,300 words of public-domain English prose (openings of Pride and Prejudice, A
Tale of Two Cities, Moby-Dick, Alice's Adventures in Wonderland, A Scandal in Bohemia and The Wind
in the Willows; the Gettysburg Address, the Declaration of Independence's preamble, Lincoln's
second inaugural address), transcribed from the public-domain originals (punctuation may differ
from a given edition). prompts.txt: 32 varied chat prompts, one a line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

HERE = Path(__file__).resolve().parent


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict], **kwargs: object) -> list[int]: ...


def corpus_text() -> str:
    return (HERE / "corpus.txt").read_text(encoding="utf-8")


def prompt_texts() -> list[str]:
    return [line for line in (HERE / "prompts.txt").read_text(encoding="utf-8").splitlines() if line.strip()]


def corpus_ids(tokenizer: Tokenizer | None) -> list[int]:
    """The corpus as token ids; without a tokenizer (the smoke model), its UTF-8 bytes."""
    text = corpus_text()
    if tokenizer is None:
        return list(text.encode())
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer: Tokenizer | None) -> list[list[int]]:
    """Each prompt through the chat template (a user turn, then the assistant's); without a
    tokenizer, each prompt's UTF-8 bytes."""
    if tokenizer is None:
        return [list(text.encode()) for text in prompt_texts()]
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            for text in prompt_texts()]
