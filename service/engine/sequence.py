"""Engine-side state of one request: its tokens, its KV blocks, how far it has been computed."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Protocol

from ..contract import FinishReason, Request, SamplingParams, TokenLogprob


class Grammar(Protocol):
    """A constrained sequence's grammar state (grammar.GrammarState)."""

    def accept(self, token: int) -> bool: ...  # True: the grammar has ended


@dataclass(eq=False, slots=True)
class Sequence:
    request: Request  # as admission made it: its id, prompt, parameters, cache scope and front
    token_ids: list[int]  # prompt followed by every generated token
    prompt_len: int
    seed: int  # resolved seed: a request without one gets a random one at admission
    max_total_len: int  # prompt + generated tokens may not exceed this (context length)
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignored) and the request's stop_token_ids
    cached_tokens: int | None = None  # prompt tokens found cached when first admitted (its usage)
    # its KV blocks, as C ints: a step's block table is these rows' bytes joined (batch.py)
    block_ids: array = field(default_factory=lambda: array("i"))
    # digests of its first full blocks (prefix caching: block_manager.py), and how many times its
    # blocks were released (a step's chunk caches its blocks only if they are still the same ones)
    block_digests: list[bytes] = field(default_factory=list)
    block_epoch: int = 0
    blocks_cached: int = 0  # of its blocks, the first this many are cached or were found cached
    # offloaded: the host pool block of each block of its K/V (ON_DEVICE: left cached, not copied)
    host_blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache (or being written by a launched step)
    num_inflight: int = 0  # sampled by a launched step, not yet seen by the host (async loop)
    finish_reason: FinishReason | None = None
    stop_token: int | None = None  # the one of its stop_token_ids that ended it (None: EOS or no token)
    # prompt logprobs (a request that asks: SamplingParams.prompt_logprobs): those of prompt tokens
    # 1.. received from finished steps, and the positions below this one whose logits a launched
    # step computes (position p's logits give token p + 1's logprob)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_next: int = 0
    num_preemptions: int = 0
    num_failed_steps: int = 0  # steps that failed with it in the batch (failure containment)
    scheduled_at: float | None = None  # wall clock of the first step that computed any of it (telemetry)
    # structured output: its grammar's matcher, fed every token it appends (None: unconstrained)
    grammar: Grammar | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def cache_scope(self) -> bytes:
        """Shares cached prefix blocks with sequences of this scope only."""
        return self.request.cache_scope

    @property
    def prompt_logprobs_from(self) -> int | None:
        """The first prompt position whose logits it still needs (its prefix cache lookup stops
        there); None if it needs none."""
        if self.params.prompt_logprobs is None or self.prompt_logprobs_next >= self.prompt_len - 1:
            return None
        return self.prompt_logprobs_next

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def length(self) -> int:
        """Tokens including the one still in flight."""
        return len(self.token_ids) + self.num_inflight

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) + self.num_inflight - self.num_computed  # length - num_computed

    @property
    def will_finish_by_length(self) -> bool:
        """Its in-flight token already reaches max_tokens or the context: nothing more to schedule."""
        if not self.num_inflight:
            return False
        length = len(self.token_ids) + self.num_inflight  # per sequence per step: no nested properties
        return length - self.prompt_len >= self.params.max_tokens or length >= self.max_total_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> None:
        """Add a sampled token and decide whether the sequence is done (stop strings are the front's;
        the end of its grammar, for a constrained one, is a stop)."""
        tokens = self.token_ids
        tokens.append(token)
        if self.grammar is not None and self.grammar.accept(token) and token not in self.stop_ids:
            self.finish_reason = FinishReason.STOP
        elif token in self.stop_ids:
            self.finish_reason = FinishReason.STOP
            if token in self.params.stop_token_ids:  # an end of sequence has no stop reason, as vLLM's
                self.stop_token = token
        elif len(tokens) - self.prompt_len >= self.params.max_tokens or len(tokens) >= self.max_total_len:
            self.finish_reason = FinishReason.LENGTH
