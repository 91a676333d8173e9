"""Structured output in the engine: each constrained request's grammar matcher, the compiled grammars
they share, and a step's token masks.

A request's constraint (`contract.StructuredOutput`, checked by its front) is compiled against the
model's tokenizer once per distinct constraint (an LRU of `cache_size` entries) and gets a matcher
of its own, held by its sequence (`Sequence.grammar`). The matcher accepts exactly the tokens the
sequence appends, so it follows the sequence through preemption (recompute keeps the tokens; only
the K/V is dropped), KV offload, prefix caching and failed steps (whose tokens are never appended)
with no rollback; an extra token of the asynchronous loop that is dropped is never accepted either.

A constraint not yet in the cache is compiled on a thread of its own (`compile_soon`): on a busy
engine its request waits outside the scheduler (engine_core) until the compile is done, while the
loop goes on stepping every other request; a first-time schema costs its own request the compile,
not everyone a stalled step. On an idle engine there is no one to stall: the request is scheduled
at once (`PENDING`), its prompt's prefill runs while the grammar compiles, and the step that
samples its first token waits for the rest of the compile. xgrammar releases the GIL while it
compiles.

A step with constrained rows samples only once their masks are filled (`fill`): one bitmask row per
sampled row, 32 tokens per int32, every bit set for a row without a grammar (its logits are left as
they are). xgrammar sees the token ids the tokenizer has, not the ids a model's vocabulary pads
past them (no text: a grammar never allows them): it scans every id it counts as special on each
token it accepts, so a vocabulary padded by tens of thousands of ids would cost each constrained
row that scan per step. The engine core fills the masks on the host while the device runs the
step's forward, and the sampler applies them on the device (sampler.mask_logits): model_runner.py
and docs/architecture.md tell the overlap.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from .. import structured_output
from ..contract import StructuredOutput, invalid
from .sequence import Sequence

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256


class GrammarState:
    """One sequence's matcher: the grammar's state after the sequence's output tokens so far."""

    __slots__ = ("matcher", "accepted")

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher
        self.accepted = 0  # output tokens accepted: the sequence's num_output, always

    def accept(self, token: int) -> bool:
        """Advance by the sequence's new token; True if the grammar has ended (nothing may follow)."""
        if not self.matcher.accept_token(token):  # the mask allowed it: only a dropped row gets here
            log.warning("a constrained sequence's token %d was refused by its grammar; it ends", token)
            return True
        self.accepted += 1
        return self.matcher.is_terminated()


class PendingGrammar:
    """The grammar of a sequence scheduled while its constraint compiles (an idle engine prefills the
    prompt meanwhile): the step that samples its first token waits for the compile
    (EngineCore._resolve), so no token ever reaches it. The constraint is the request's own."""

    __slots__ = ()

    def accept(self, token: int) -> bool:
        raise RuntimeError("a token reached a sequence whose grammar was never resolved")


PENDING = PendingGrammar()


def tokenizer_ids(tokenizer: PreTrainedTokenizerBase) -> int:
    """How many token ids the tokenizer knows (its added tokens included): one past the largest."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


class Grammars:
    """The model's tokenizer as xgrammar sees it, the compiled-grammar cache, the masks' host buffers."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: frozenset[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        pin_memory: bool = False,
        threads: int = 1,
    ) -> None:
        """`vocab_size`: the model's (its logits' width, which may exceed the tokenizer's);
        `stop_token_ids`: what ends a sequence at the end of its grammar (the model's EOS);
        `threads`: that fill a step's masks (on the CPU the model's own threads need the cores)."""
        self.grammar_vocab = min(vocab_size, tokenizer_ids(tokenizer))  # the ids xgrammar sees
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.grammar_vocab, stop_token_ids=sorted(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.compiled = self.hits = 0  # grammars compiled, and constraints found in the cache
        self.pin_memory = pin_memory
        self._masks: dict[int, torch.Tensor] = {}  # the host bitmask of each step slot
        self._narrow: torch.Tensor | None = None  # xgrammar's rows where the vocabulary is padded
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._pending: dict[StructuredOutput, Future[xgr.CompiledGrammar]] = {}

    def ready(self, constraint: StructuredOutput) -> bool:
        """Compiled and cached: a matcher for it is made at once."""
        return constraint in self.cache

    def compile_soon(self, constraint: StructuredOutput) -> None:
        """Start compiling `constraint` on the compile thread (once, however many requests ask)."""
        if constraint not in self._pending:
            self._pending[constraint] = self._pool.submit(self._build, constraint)

    def done(self, constraint: StructuredOutput) -> bool:
        """Its compile has ended (or none is under way): `state_for` will not wait."""
        future = self._pending.get(constraint)
        return future is None or future.done()

    def wait_for_any(self, timeout: float) -> None:
        """Block until some compile under way ends, or `timeout` seconds."""
        if self._pending:
            wait(list(self._pending.values()), timeout, return_when=FIRST_COMPLETED)

    def _build(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(structured_output.build(constraint))

    def compile(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar: from the cache, from the compile thread, or compiled now."""
        grammar = self.cache.get(constraint)
        if grammar is not None:
            self.cache.move_to_end(constraint)
            self.hits += 1
            return grammar
        future = self._pending.pop(constraint, None)
        try:
            grammar = future.result() if future is not None else self._build(constraint)
        except (ValueError, RuntimeError) as exc:  # its front checked it: only the tokenizer could refuse
            raise invalid(f"the {constraint.kind} cannot be compiled for this model: {exc}") from exc
        self.compiled += 1
        self.cache[constraint] = grammar
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return grammar

    def state_for(self, seq: Sequence) -> GrammarState:
        """A new sequence's matcher. Its grammar ends with one of its stop tokens (EOS, unless the
        request ignores it, and its stop_token_ids), or the model's EOS where it has none."""
        stops = sorted(seq.stop_ids) or self.stop_token_ids
        matcher = xgr.GrammarMatcher(self.compile(seq.params.structured_output), override_stop_tokens=stops)
        return GrammarState(matcher)

    def fill(self, seqs: list[Sequence], slot: int) -> torch.Tensor:
        """The bitmask of a step's sampled rows (`seqs`, in row order), in the host buffer of `slot`
        (a slot's buffer is filled again only after the step that read it is done)."""
        mask = self._masks.get(slot)
        width = (self.vocab_size + 31) // 32
        if mask is None or mask.shape[0] < len(seqs):
            mask = torch.empty((max(len(seqs), 64), width), dtype=torch.int32, pin_memory=self.pin_memory)
            self._masks[slot] = mask
        mask = mask[: len(seqs)]
        mask.fill_(-1)
        matchers, rows = [], []
        for row, seq in enumerate(seqs):
            state = seq.grammar
            # a sequence that ended meanwhile (its row's token is dropped) keeps every bit
            if state is not None and not seq.finished and not state.matcher.is_terminated():
                matchers.append(state.matcher)
                rows.append(row)
        if matchers and self.grammar_vocab == self.vocab_size:
            self._batch.batch_fill_next_token_bitmask(matchers, mask, rows)
        elif matchers:
            self._fill_padded(matchers, rows, mask)
        return mask

    def _fill_padded(self, matchers: list[xgr.GrammarMatcher], rows: list[int], mask: torch.Tensor) -> None:
        """The constrained rows of `mask` where the model's vocabulary pads the tokenizer's: xgrammar
        fills its own narrower rows (it writes them contiguously), the padding ids none allowed."""
        words = (self.grammar_vocab + 31) // 32
        if self._narrow is None or self._narrow.shape[0] < mask.shape[0]:
            self._narrow = torch.empty((mask.shape[0], words), dtype=torch.int32)
        narrow = self._narrow[: mask.shape[0]]
        self._batch.batch_fill_next_token_bitmask(matchers, narrow, rows)
        # every row constrained (the common case): slices, copied at memory speed; else the rows'
        index: slice | torch.Tensor = slice(0, len(rows)) if rows[-1] == len(rows) - 1 else torch.tensor(rows)
        mask[index, :words] = narrow[index]
        mask[index, words:] = 0
        if self.grammar_vocab % 32:  # the last word's bits past the tokenizer's ids
            mask[index, words - 1] &= (1 << self.grammar_vocab % 32) - 1

