"""The engine on CUDA: same greedy tokens as transformers generate() (on a GPU: -m gpu)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_config
from engine_harness import Arrival, hf_greedy, make_core, run
from transformers import AutoModelForCausalLM

from tandem.service.contract import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("num_blocks", [512, 40])  # 40 blocks x 4 tokens forces preemption
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("loop", ["sync", "async"])
def test_cuda_engine_matches_generate(family, num_blocks, graphs, loop):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_tiny_config(family, 1000)).to("cuda").eval()
    rng = random.Random(1)
    arrivals = [
        Arrival(f"r{i}", [rng.randrange(1000) for _ in range(n)], SamplingParams(max_tokens=24), at)
        for i, (n, at) in enumerate(zip([7, 60, 2, 33, 15, 90], [0, 0, 1, 3, 8, 12], strict=True))
    ]
    # graphs need the in-place kernel, which needs 16-token blocks: same capacity in fewer blocks
    core = make_core(
        model,
        num_blocks=num_blocks // 4 if graphs else num_blocks,
        block_size=16 if graphs else 4,
        max_num_batched_tokens=64,
        max_model_len=160,
        max_num_seqs=8,
        cuda_graphs=graphs,
        step_loop=loop,
    )
    assert core.async_loop == (loop == "async")
    result = run(core, arrivals)
    if num_blocks == 40:
        assert result.preemptions > 0
    if graphs:
        # buckets 1, 2, 4, 8 x slots A, B x greedy / sampled
        assert core.runner.graphs is not None and len(core.runner.graphs.graphs) == 16
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(model, a.prompt_ids, 24, None), a.request_id


def test_cuda_seeded_sampling_matches_cpu():
    """The counter-based sampler draws the same noise on both devices."""
    from tandem.service.engine.sampler import uniform_noise

    seeds, steps = torch.tensor([1, 99, 2**62]), torch.tensor([0, 5, 123])
    cpu = uniform_noise(seeds, steps, 4096)
    gpu = uniform_noise(seeds.cuda(), steps.cuda(), 4096).cpu()
    assert torch.equal(cpu, gpu)


def _tiny_cuda(family: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_tiny_config(family, 1000)).to("cuda").eval()


def _arrivals(params: SamplingParams, seed: int = 1) -> list[Arrival]:
    rng = random.Random(seed)
    return [
        Arrival(f"r{i}", [rng.randrange(1000) for _ in range(n)], params, at)
        for i, (n, at) in enumerate(zip([7, 60, 2, 33, 15, 90], [0, 0, 1, 3, 8, 12], strict=True))
    ]


def _core(model: torch.nn.Module, graphs: bool, compile_backend: str | None = None, fuse: bool = False,
          layout: str = "NHD", blas: str = "default", compile_prefill: bool = False,
          fold_rotary: bool = True):
    return make_core(model, num_blocks=64, block_size=16, max_num_batched_tokens=64, max_model_len=160,
                     max_num_seqs=8, cuda_graphs=graphs, step_loop="async", compile_backend=compile_backend,
                     fuse_projections=fuse, kv_cache_layout=layout, blas_library=blas,
                     compile_prefill=compile_prefill, fold_rotary=fold_rotary)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-projections"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cuda_compiled_graphs_match_generate(family, fuse):
    """Inductor-compiled decode forward, captured per slot and bucket, async loop; with fused
    projections (the server's CUDA default) too. The reference is an untouched twin model."""
    model, twin = _tiny_cuda(family), _tiny_cuda(family)
    arrivals = _arrivals(SamplingParams(max_tokens=24))
    result = run(_core(model, graphs=True, compile_backend="inductor", fuse=fuse), arrivals)
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(twin, a.prompt_ids, 24, None), a.request_id


@pytest.mark.parametrize("family, fold_rotary", [("llama", True), ("qwen3", True), ("llama", False)],
                         ids=["llama", "qwen3", "llama-rotary-in-model"])
def test_cuda_compiled_prefill_matches_generate(family, fold_rotary):
    """The server's CUDA engine: prefill and mixed steps through Inductor too (symbolic token
    count, eager attention; their K/V written and Q and K rotated by the write kernel), compiled
    by the start-up warm-up; no step of the run compiles again, neither a frame nor a Triton
    variant of the engine's kernels (write, decode, merge). With `--no-fold-rotary` (the rotary
    left in the model code) the write kernel only writes K/V."""
    from torch._dynamo.utils import counters

    from tandem.service.engine.ops.triton_variants import compiled_variants

    model, twin = _tiny_cuda(family), _tiny_cuda(family)
    arrivals = _arrivals(SamplingParams(max_tokens=24))
    core = _core(model, graphs=True, compile_backend="inductor", fuse=True, compile_prefill=True,
                 fold_rotary=fold_rotary)
    assert core.runner.prefill_compiled and (core.runner.rotary is not None) == fold_rotary
    warmed, warmed_variants = counters["frames"]["ok"], compiled_variants()
    assert warmed_variants > 0
    result = run(core, arrivals)
    assert counters["frames"]["ok"] == warmed
    assert compiled_variants() == warmed_variants
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(twin, a.prompt_ids, 24, None), a.request_id


def test_cuda_packed_prompt_chunks_match_per_chunk_attention():
    """A bf16 model (FlashAttention-2 takes half precision): the packed prompt path, one
    variable-length flash call per layer (the CUDA default), gives the tokens of the per-chunk
    SDPA path through chunked prompts continued over cached prefixes, mixed steps and preemption."""
    model = _tiny_cuda("llama").to(torch.bfloat16)
    arrivals = _arrivals(SamplingParams(max_tokens=24))
    tokens, preempted = {}, {}
    for packed in (True, False):
        core = make_core(model, num_blocks=10, block_size=16, max_num_batched_tokens=64, max_model_len=160,
                         max_num_seqs=8, cuda_graphs=True, step_loop="async")
        assert core.runner.varlen_prefill  # chosen by default on this device
        core.runner.varlen_prefill = packed
        result = run(core, arrivals)
        tokens[packed], preempted[packed] = result.tokens, result.preemptions
    assert preempted[True] > 0
    assert tokens[True] == tokens[False]


def test_cuda_cublaslt_engine_matches_generate():
    """`blas_library=cublaslt` makes PyTorch prefer cuBLASLt for the engine's GEMMs (captured in the
    graphs); the tokens stay the untouched twin's."""
    model, twin = _tiny_cuda("llama"), _tiny_cuda("llama")
    arrivals = _arrivals(SamplingParams(max_tokens=24))
    try:
        core = _core(model, graphs=True, compile_backend="inductor", fuse=True, blas="cublaslt")
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        result = run(core, arrivals)
    finally:
        torch.backends.cuda.preferred_blas_library("default")
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(twin, a.prompt_ids, 24, None), a.request_id


@pytest.mark.parametrize("compile_backend", [None, "inductor"], ids=["graphs", "compiled-graphs"])
def test_cuda_head_major_cache_matches_generate(compile_backend):
    """The HND cache layout (each KV head's tokens together) on CUDA: mixed steps through the
    kernel on the transposed view, decode graphs through the op over the storage itself."""
    model, twin = _tiny_cuda("llama"), _tiny_cuda("llama")
    arrivals = _arrivals(SamplingParams(max_tokens=24))
    core = _core(model, graphs=True, compile_backend=compile_backend, fuse=True, layout="HND")
    assert core.runner.cache.head_major
    result = run(core, arrivals)
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(twin, a.prompt_ids, 24, None), a.request_id


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0.8, seed=7),  # sampled inside the graph
        SamplingParams(max_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=7),  # after the replay
        SamplingParams(max_tokens=20, temperature=0.8, seed=7, logprobs=True, top_logprobs=2),
    ],
    ids=["temperature", "top_k_top_p", "logprobs"],
)
def test_cuda_seeded_sampling_same_with_and_without_graphs(params):
    model = _tiny_cuda()
    eager = run(_core(model, graphs=False), _arrivals(params))
    graphed = run(_core(model, graphs=True), _arrivals(params))
    assert graphed.tokens == eager.tokens
    greedy = run(_core(model, graphs=True), _arrivals(SamplingParams(max_tokens=20)))
    assert greedy.tokens != graphed.tokens  # the sampled graphs really sampled


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_cuda_step_stages_from_events_on_the_wall_clock(loop):
    """h2d -> compute -> d2h come from CUDA events, converted to wall-clock time without a sync."""
    import time

    model = _tiny_cuda()
    core = make_core(model, num_blocks=64, block_size=16, max_num_batched_tokens=64, max_model_len=160,
                     max_num_seqs=8, cuda_graphs=True, step_loop=loop)
    timings = []
    core.step_observer = timings.append
    before = time.time()
    run(core, _arrivals(SamplingParams(max_tokens=12)))
    after = time.time()
    assert timings and all(t.h2d and t.compute and t.d2h for t in timings)
    slack = 0.005  # the clock's anchor is read just after a device sync
    for t in timings:
        assert before - slack <= t.h2d[0] <= t.h2d[1] <= t.compute[0] + slack
        assert t.compute[0] <= t.compute[1] <= t.d2h[0] + slack and t.d2h[0] <= t.d2h[1] <= after + slack
        assert t.prepare[0] <= t.prepare[1] <= t.h2d[0] + slack
    assert any(t.graph_bucket is not None for t in timings)
    assert {t.slot for t in timings} == {0, 1}
    for a, b in zip(timings, timings[1:], strict=False):  # one compute stream: steps in order
        assert a.compute[1] <= b.compute[0] + slack


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("loop", ["sync", "async"])
def test_cuda_prefix_caching_matches_generate(graphs, loop):
    """Shared system prompts on CUDA: cached blocks read by later requests' prefill chunks and
    by a request whose whole prompt but one token is cached (its first step is a decode, through
    the captured graphs), with preemption; generate()'s greedy tokens, and the cache was used."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_tiny_config("llama", 1000)).to("cuda").eval()
    rng = random.Random(4)
    system = [rng.randrange(1000) for _ in range(48)]
    tails = [5, 17, 1, 30, 0, 9]
    arrivals = [
        Arrival(f"r{i}", system + [rng.randrange(1000) for _ in range(n)], SamplingParams(max_tokens=24), at)
        for i, (n, at) in enumerate(zip(tails, [0, 2, 4, 4, 7, 9], strict=True))
    ]
    core = make_core(
        model, num_blocks=14, block_size=16, max_num_batched_tokens=64, max_model_len=160, max_num_seqs=8,
        cuda_graphs=graphs, step_loop=loop, prefix_caching=True,
    )  # fmt: skip
    result = run(core, arrivals)
    assert core.scheduler.blocks.hit_tokens >= 3 * 48
    assert result.preemptions > 0
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(model, a.prompt_ids, 24, None), a.request_id


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("loop", ["sync", "async"])
@pytest.mark.parametrize("shared", [0, 32])
def test_cuda_kv_offload_matches_generate(layout, graphs, loop, shared):
    """Preempted sequences' K/V copied to pinned host memory and back on the offload stream while
    steps run, into other blocks than they left: generate()'s greedy tokens, no recompute. With a
    prefix all prompts share (prefix caching on), the blocks of it that running sequences hold are
    left on the device and shared again."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_tiny_config("llama", 1000)).to("cuda").eval()
    rng = random.Random(6)
    common = [rng.randrange(1000) for _ in range(shared)]
    arrivals = [
        Arrival(f"r{i}", common + [rng.randrange(1000) for _ in range(n)], SamplingParams(max_tokens=40), at)
        for i, (n, at) in enumerate(zip([70, 25, 90, 40, 55, 12, 66], [0, 0, 1, 2, 4, 5, 9], strict=True))
    ]
    core = make_core(
        model, num_blocks=16, block_size=16, max_num_batched_tokens=64, max_model_len=192, max_num_seqs=8,
        cuda_graphs=graphs, step_loop=loop, kv_cache_layout=layout, kv_offload_blocks=64,
        prefix_caching=bool(shared),
    )  # fmt: skip
    assert core.runner.offload is not None and core.runner.offload.store.is_pinned()
    result = run(core, arrivals)
    s = core.scheduler
    assert s.preempted_offload > 0 and s.preempted_recompute == 0
    assert s.blocks_restored + s.blocks_reused == s.blocks_offloaded
    assert (s.blocks_kept > 0) == bool(shared)
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(model, a.prompt_ids, 40, None), a.request_id
