"""Device sampling: greedy, filters, distribution, and seeds independent of batch mates."""

from __future__ import annotations

import torch

from tandem.service.engine.batch import SamplingTensors
from tandem.service.engine.sampler import sample, uniform_noise


def tensors(temps, top_ps=None, top_ks=None, seeds=None, steps=None, logprobs=-1) -> SamplingTensors:
    n = len(temps)
    top_ps = top_ps or [1.0] * n
    top_ks = top_ks or [0] * n
    return SamplingTensors(
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_p=torch.tensor(top_ps, dtype=torch.float32),
        top_k=torch.tensor(top_ks),
        seeds=torch.tensor(seeds or list(range(n))),
        steps=torch.tensor(steps or [0] * n),
        all_greedy=all(t == 0 for t in temps),
        needs_filter=any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps),
        num_logprobs=logprobs,
    )


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    assert torch.equal(sample(logits, tensors([0.0] * 5)).tokens, logits.argmax(-1))


def test_greedy_in_bf16_picks_what_float_would_ties_included():
    """All-greedy steps take the argmax in the model's dtype, without a float copy: the same token
    as over the upcast logits, the first of tied maxima included; mixed steps agree on greedy rows."""
    logits = torch.randn(6, 4096).to(torch.bfloat16)  # bf16's coarse grid makes ties common
    logits[0, 7] = logits[0, 900] = logits[0].max() + 1  # an exact tie: the lower id wins
    expected = logits.float().argmax(-1)
    assert expected[0] == 7
    assert torch.equal(sample(logits, tensors([0.0] * 6)).tokens, expected)
    mixed = sample(logits, tensors([0.0, 0.7, 0.0, 0.0, 1.0, 0.0], logprobs=0))
    greedy_rows = [0, 2, 3, 5]
    assert torch.equal(mixed.tokens[greedy_rows], expected[greedy_rows])
    assert mixed.logprobs is not None and mixed.logprobs.dtype == torch.float32


def test_seeded_row_does_not_depend_on_batch_mates():
    torch.manual_seed(0)
    row = torch.randn(1, 500)
    alone = sample(row, tensors([1.0], seeds=[1234], steps=[7])).tokens
    for mates in range(1, 6):
        batch = torch.cat([torch.randn(mates, 500), row])
        st = tensors([0.7] * mates + [1.0], seeds=list(range(mates)) + [1234], steps=[0] * mates + [7])
        assert sample(batch, st).tokens[-1] == alone[0]


def test_noise_is_uniform_and_varies_with_seed_and_step():
    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 20_000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_sampling_follows_the_softmax_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    n = 4000
    st = tensors([1.0] * n, seeds=list(range(n)))
    counts = torch.bincount(sample(logits.expand(n, 3), st).tokens, minlength=3).float() / n
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]])).expand(2000, 4)
    k2 = sample(logits, tensors([1.0] * 2000, top_ks=[2] * 2000, seeds=list(range(2000)))).tokens
    assert set(k2.tolist()) == {0, 1}
    p = sample(logits, tensors([1.0] * 2000, top_ps=[0.7] * 2000, seeds=list(range(2000)))).tokens
    assert set(p.tolist()) == {0, 1}  # 0.5 alone < 0.7; 0.5 + 0.25 covers it
    tiny_p = sample(logits[:50], tensors([1.0] * 50, top_ps=[1e-6] * 50, seeds=list(range(50)))).tokens
    assert set(tiny_p.tolist()) == {0}  # the most likely token always survives


def test_logprobs_and_top_alternatives():
    logits = torch.randn(3, 50)
    out = sample(logits, tensors([0.0] * 3, logprobs=4))
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, ref.max(-1).values)
    assert out.top_ids.shape == (3, 4)
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_a_token_whose_logit_is_minus_infinity_is_never_sampled_even_at_the_top_noise():
    # seed 13, step 0 draws the top 24-bit value at vocabulary id 593417: in float32 its uniform
    # would round to 1.0 and its Gumbel noise to +inf, which beats any logit, -inf included (NaN)
    vocab, top = 593_418, 593_417
    u = uniform_noise(torch.tensor([13]), torch.tensor([0]), vocab)
    assert u[0, top] < 1
    logits = torch.zeros(1, vocab)
    logits[0, top] = float("-inf")  # masked (structured output) or filtered (top-k / top-p)
    assert sample(logits, tensors([1.0], seeds=[13], steps=[0])).tokens[0] != top
