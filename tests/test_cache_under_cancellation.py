"""Prefix caching and KV offload under cancellation and concurrency, over the wire: a real `tandem
serve` of the tiny llama with a KV cache small enough to preempt, prefix caching on, a host pool too
small for every preemption (both offload and recompute happen), chunked prefill, the asynchronous
step loop; real clients (grpc stubs, the openai client) that go away at random points.

After each storm: every answer (whole or the part a cancelled client saw) is transformers'
generate() greedy answer, or its beginning; every KV block and every pool block comes back; the
prefix-cache counters are consistent; no status is UNKNOWN and the log has no traceback.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
import torch
from engine_harness import hf_greedy
from prometheus_samples import grown, scrape, value
from serverproc import ServerFactory, wait_idle
from transformers import AutoModelForCausalLM

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MODEL = "tiny-pressed"
BLOCK = 16  # the server's KV block size (the default)
NUM_BLOCKS = 32  # 512 tokens: three requests of the longest kind nearly fill it
MAX_MODEL_LEN = 160
TIMEOUT = 60.0
QUERIES, HITS = "tandem_prefix_cache_queries_total", "tandem_prefix_cache_hits_total"
MODES = ("offload", "recompute")  # of tandem_preemptions_total


@dataclass
class Server:
    address: str
    base_url: str  # the OpenAI HTTP API
    metrics_url: str
    log: Path


@pytest.fixture(scope="module")
def server(serve: ServerFactory) -> Server:
    live = serve(
        "--model-name", MODEL,
        "--num-kv-blocks", str(NUM_BLOCKS),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-offload-gib", "0.0002",  # 26 blocks of this model's K/V: room for some preemptions only
        "--max-num-batched-tokens", "32",  # prompts prefill in several chunks: cancellable mid-prefill
        "--step-loop", "async",  # the CUDA default: step N+1 is scheduled before step N's tokens are in
        http=True,
        metrics=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while HITS not in scrape(live.metrics_url):  # the engine's first report has not come yet
        assert time.monotonic() < deadline, "no prefix-cache counters on /metrics"
        time.sleep(0.2)
    return Server(live.address, f"{live.http_url}/v1", live.metrics_url, live.log)


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()


@pytest.fixture(scope="module")
def stub(server: Server) -> Iterator[pb_grpc.TandemStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TandemStub(channel)


def preemptions(before: dict, after: dict) -> float:
    return sum(grown(before, after, "tandem_preemptions_total", mode=m) for m in MODES)


@dataclass
class Job:
    """One request of a storm and what its client does."""

    prompt: list[int]
    max_tokens: int
    salt: str | None
    api: str  # "grpc" or "http"
    cancel: str  # "never", "early" (a few ms in: queued or mid-prefill), "first" (after its first
    # message), "mid" (after a few messages)
    seen: list[int]  # tokens the client received
    outcome: str = ""  # "done", "cancelled", or the failure


def _native_job(stub: pb_grpc.TandemStub, job: Job, rng: random.Random) -> None:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=job.prompt),
        stopping=pb.StoppingCriteria(max_tokens=job.max_tokens, ignore_eos=True),
    )
    if job.salt is not None:
        req.cache_salt = job.salt
    call = stub.GenerateStream(req, timeout=TIMEOUT)
    if job.cancel == "early":
        threading.Timer(rng.uniform(0.0, 0.05), call.cancel).start()
    stop_after = {"first": 1, "mid": rng.randint(2, 6)}.get(job.cancel)
    messages = 0
    try:
        for msg in call:
            job.seen += msg.token_ids
            messages += 1
            if messages == stop_after:
                call.cancel()
        job.outcome = "done"
    except grpc.RpcError as err:
        job.outcome = "cancelled" if err.code() == grpc.StatusCode.CANCELLED else f"{err.code()}: {err}"


def _http_job(client: openai.OpenAI, job: Job, rng: random.Random) -> None:
    extra: dict = {"ignore_eos": True, "return_token_ids": True}
    if job.salt is not None:
        extra["cache_salt"] = job.salt
    stream = client.completions.create(
        model=MODEL,
        prompt=job.prompt,
        max_tokens=job.max_tokens,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    if job.cancel == "early":
        time.sleep(rng.uniform(0.0, 0.05))
        stream.close()  # the connection goes: the server sees the client gone
        job.outcome = "cancelled"
        return
    stop_after = {"first": 1, "mid": rng.randint(2, 6)}.get(job.cancel)
    messages = 0
    for chunk in stream:
        job.seen += chunk.choices[0].token_ids or [] if chunk.choices else []
        messages += 1
        if messages == stop_after:
            stream.close()
            job.outcome = "cancelled"
            return
    job.outcome = "done"


def _storm_jobs(vocab: int, seed: int, count: int) -> list[Job]:
    """`count` requests over three shared prefixes of 3-5 full blocks, each under one of three cache
    scopes (no salt, two salts), with tails that end on, just before and just after block edges."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(BLOCK * n)] for n in (3, 4, 5)]
    jobs = []
    for _ in range(count):
        prefix = rng.choice(prefixes)
        tail = rng.choice([0, 1, BLOCK - 1, BLOCK, BLOCK + 1, rng.randint(2, 30)])
        prompt = prefix + [rng.randrange(vocab) for _ in range(tail)]
        max_tokens = rng.randint(1, MAX_MODEL_LEN - len(prompt))  # most grow by blocks: preemption
        cancel = rng.choice(["never", "never", "early", "first", "mid"])
        jobs.append(
            Job(prompt, max_tokens, rng.choice([None, "s1", "s2"]), rng.choice(["grpc", "http"]), cancel, [])
        )
    return jobs


def _overflowing_jobs(vocab: int, seed: int) -> list[Job]:
    """Four streams that are never cancelled, each to the context limit (10 blocks), of distinct
    random prompts: running together they need 40 blocks of the 32, so the cache overflows whenever
    the storm's cancellations happen to fall."""
    rng = random.Random(-1 - seed)
    prompt_len = BLOCK * 5
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(4)]
    return [Job(prompt, MAX_MODEL_LEN - prompt_len, None, "grpc", "never", []) for prompt in prompts]


def _run_storm(
    server: Server, stub: pb_grpc.TandemStub, jobs: list[Job], seed: int, overflowing: list[Job]
) -> list[dict]:
    """Start the `overflowing` jobs and wait until each streams, then run every other job at once;
    meanwhile scrape /metrics again and again. Returns the scrapes."""
    scrapes = [scrape(server.metrics_url)]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            scrapes.append(scrape(server.metrics_url))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=TIMEOUT)
    try:
        with futures.ThreadPoolExecutor(len(overflowing) + len(jobs)) as pool:
            runs = [pool.submit(_native_job, stub, job, random.Random(seed)) for job in overflowing]
            deadline = time.monotonic() + TIMEOUT
            while not all(job.seen for job in overflowing):  # all four admitted and decoding
                assert time.monotonic() < deadline, "the overflowing streams never started"
                time.sleep(0.01)
            for i, job in enumerate(jobs):
                rng = random.Random(seed * 1000 + i)
                if job.api == "grpc":
                    runs.append(pool.submit(_native_job, stub, job, rng))
                else:
                    runs.append(pool.submit(_http_job, client, job, rng))
            for run in runs:
                run.result()
    finally:
        done.set()
        watcher.join()
        client.close()
    wait_idle(stub, timeout=10.0)
    scrapes.append(scrape(server.metrics_url))
    return scrapes


def _check_counters(scrapes: list[dict]) -> None:
    """Counters never go back, hits never exceed queries, and the pool is empty at the end."""
    for name, labels in [
        (QUERIES, {}),
        (HITS, {}),
        *[("tandem_preemptions_total", {"mode": m}) for m in MODES],
    ]:
        series = [value(s, name, **labels) for s in scrapes]
        assert series == sorted(series), (name, labels, series)
    for s in scrapes:
        assert 0 <= value(s, HITS) <= value(s, QUERIES)
    last = scrapes[-1]
    out = value(last, "tandem_kv_offload_blocks_total", direction="out")
    back = value(last, "tandem_kv_offload_blocks_total", direction="in")
    assert back + value(last, "tandem_kv_offload_blocks_total", direction="reused") <= out
    assert value(last, "tandem_kv_offload_usage_ratio") == 0
    assert value(last, "tandem_requests_running") == 0


def _generate(stub: pb_grpc.TandemStub, prompt: list[int], max_tokens: int | None, salt: str | None = None):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), stopping=pb.StoppingCriteria(ignore_eos=True))
    if max_tokens is not None:
        req.stopping.max_tokens = max_tokens
    if salt is not None:
        req.cache_salt = salt
    return stub.Generate(req, timeout=TIMEOUT)


def _alone(stub: pb_grpc.TandemStub, jobs: list[Job], scope: str | None = None) -> list[list[int]]:
    """Each job's greedy tokens run alone on the idle server: in its own scope, or in `scope`-salted
    scopes of their own (which the storm's requests never share)."""
    salt = (lambda j: j.salt) if scope is None else (lambda j: f"{scope}-{j.salt}")
    return [list(_generate(stub, j.prompt, j.max_tokens, salt(j)).token_ids) for j in jobs]


@pytest.mark.parametrize("seed", range(int(os.environ.get("TANDEM_STORM_SEEDS", "2"))))
def test_cancelled_clients_never_change_what_the_others_get(server, stub, llama, seed):
    """24 streams at once over three shared prefixes and three scopes, native and HTTP, a third of
    them cancelled (queued or mid-prefill, after the first token, mid-decode), in a cache that
    preempts (four long streams, started first, overflow it): each answer is the one its prompt
    gets alone (a cancelled one: its beginning)."""
    storm = _storm_jobs(llama.config.vocab_size, seed, count=24)
    overflowing = _overflowing_jobs(llama.config.vocab_size, seed)
    jobs = storm + overflowing
    wait_idle(stub)
    alone = _alone(stub, jobs, f"alone-{seed}")
    for i in (0, 1, -1):  # the reference itself is generate()'s
        assert alone[i] == hf_greedy(llama, jobs[i].prompt, jobs[i].max_tokens, None)
    scrapes = _run_storm(server, stub, storm, seed, overflowing)
    _check_counters(scrapes)
    assert preemptions(scrapes[0], scrapes[-1]) > 0, "the storm was meant to overflow the KV cache"
    assert [(j.api, j.cancel, j.outcome) for j in jobs if j.outcome not in ("done", "cancelled")] == []
    assert sum(j.outcome == "cancelled" for j in jobs) >= 4, "the storm was meant to cancel requests"
    for job, want in zip(jobs, alone, strict=True):
        if job.outcome == "done":
            assert job.seen == want, job
        else:
            assert job.seen == want[: len(job.seen)], job
    # and again, each alone on the idle server, now finding what the storm cached in its scope
    assert _alone(stub, jobs) == alone
    wait_idle(stub)


def test_a_prompt_waiting_for_room_is_looked_up_in_the_prefix_cache_once(server, stub, llama):
    """Four prompts of 150 tokens (10 blocks each, their whole context) in a 32-block cache: three
    run, the fourth waits for room for many steps without being preempted or admitted. Each is
    looked up once, when admitted (docs/telemetry.md), however long it waited."""
    rng = random.Random(77)
    prompts = [[rng.randrange(llama.config.vocab_size) for _ in range(150)] for _ in range(4)]
    wait_idle(stub)
    before = scrape(server.metrics_url)
    with futures.ThreadPoolExecutor(len(prompts)) as pool:
        usages = list(pool.map(lambda p: _generate(stub, p, MAX_MODEL_LEN - 150).usage, prompts))
    wait_idle(stub)
    after = scrape(server.metrics_url)
    assert preemptions(before, after) == 0
    assert [u.cached_prompt_tokens for u in usages] == [0] * 4
    assert grown(before, after, HITS) == 0
    assert grown(before, after, QUERIES) == 4 * 150


@pytest.mark.parametrize(
    "length",
    [BLOCK * 3 - 1, BLOCK * 3, BLOCK * 3 + 1, MAX_MODEL_LEN - BLOCK, MAX_MODEL_LEN - 2, MAX_MODEL_LEN - 1],
)
def test_prompts_at_block_edges_and_the_context_limit_behind_a_cached_prefix(server, stub, llama, length):
    """A prompt of `length` tokens whose every full block but the last is cached (its own earlier
    run), asking for exactly the room left: all of it, finish LENGTH, the cached tokens reported, and
    generate()'s tokens; one more token than fits is INVALID_ARGUMENT (HTTP 400), and so is a prompt
    that fills the context; no max_tokens gets the room left."""
    rng = random.Random(length)
    prompt = [rng.randrange(llama.config.vocab_size) for _ in range(length)]
    room = MAX_MODEL_LEN - length
    want = hf_greedy(llama, prompt, room, None)
    first = _generate(stub, prompt, room, salt="edges")
    again = _generate(stub, prompt, None, salt="edges")  # the server's default: what fits
    for resp in (first, again):
        assert list(resp.token_ids) == want and resp.finish_reason == pb.FINISH_REASON_LENGTH
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens == (length - 1) // BLOCK * BLOCK
    for bad in ((prompt, room + 1), (prompt + want[:room], 1)):
        with pytest.raises(grpc.RpcError) as err:
            _generate(stub, *bad, salt="edges")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=TIMEOUT)
    with client:
        extra = {"ignore_eos": True, "return_token_ids": True, "cache_salt": "edges"}
        done = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=room, temperature=0, extra_body=extra
        )
        assert done.choices[0].token_ids == want and done.choices[0].finish_reason == "length"
        assert done.usage.prompt_tokens_details.cached_tokens == (length - 1) // BLOCK * BLOCK
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=room + 1, extra_body=extra)
    wait_idle(stub)


def _stream(stub: pb_grpc.TandemStub, prompt: list[int], max_tokens: int) -> grpc.Future:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )
    return stub.GenerateStream(req, timeout=TIMEOUT)


def test_a_request_cancelled_while_offloaded_gives_its_pool_blocks_back(server, stub, llama):
    """Four requests of 100 + 60 tokens in a 32-block cache: they grow past it, the newest is
    preempted to the host pool, and its client goes away while it waits there. Its pool blocks come
    back at once (the others still running), it never comes back in, and the requests that follow
    get generate()'s tokens."""
    rng = random.Random(5)
    vocab = llama.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(100)] for _ in range(4)]
    for _ in range(3):  # the victim must be cancelled before the others finish: rarely missed
        wait_idle(stub)
        before = scrape(server.metrics_url)
        calls, first = [], []  # the streams, and the tokens of each one's first message
        for prompt in prompts:  # admitted in this order: the last is the newest, the one preempted
            calls.append(_stream(stub, prompt, 60))
            first.append(list(next(calls[-1]).token_ids))
        victim, others = calls[-1], calls[:-1]
        deadline = time.monotonic() + TIMEOUT
        while (load := stub.GetLoad(pb.LoadRequest(), timeout=TIMEOUT)).requests_waiting == 0:
            assert time.monotonic() < deadline, load
            if load.requests_running < 4:  # the first ended before the cache ran out: a missed round
                break
        if load.requests_waiting == 0:
            for prompt, head, call in zip(prompts, first, calls, strict=True):  # all run to their end
                tokens = head + [t for m in call for t in m.token_ids]
                assert len(tokens) == 60 and tokens == hf_greedy(llama, prompt, 60, None)
            continue
        victim.cancel()
        # /metrics shows the engine's stats as of its last step report, which may predate the abort:
        # read until the pool is back, then ask whether the others still run (they ran then too)
        while (pool_now := value(scrape(server.metrics_url), "tandem_kv_offload_usage_ratio")) != 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        running = stub.GetLoad(pb.LoadRequest(), timeout=TIMEOUT).requests_running
        finished = [
            head + [t for m in call for t in m.token_ids]
            for head, call in zip(first[:-1], others, strict=True)
        ]
        wait_idle(stub)
        after = scrape(server.metrics_url)
        out, back, reused = (
            grown(before, after, "tandem_kv_offload_blocks_total", direction=d)
            for d in ("out", "in", "reused")
        )
        assert grown(before, after, "tandem_preemptions_total", mode="offload") >= 1 and out > 0
        assert value(after, "tandem_kv_offload_usage_ratio") == 0
        for prompt, tokens in zip(prompts, finished, strict=False):
            assert len(tokens) == 60 and tokens == hf_greedy(llama, prompt, 60, None)
        if running == 3 and out > back + reused:  # cancelled while the others ran, and while offloaded
            assert pool_now == 0
            break
    else:
        pytest.fail("the victim was never cancelled while offloaded and the others still ran")
    for prompt in prompts:
        assert list(_generate(stub, prompt, 20).token_ids) == hf_greedy(llama, prompt, 20, None)


def test_the_log_has_no_traceback(server):
    text = server.log.read_text()
    assert "Traceback" not in text and "UNKNOWN" not in text, text[-3000:]
