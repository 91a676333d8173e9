"""The soak's big-prompt phase: `--big-prompts N` senders at once, each sending text prompts of
4 MB (just under the 4 MiB message limit) down to 64 KB of UTF-8 in turn, while the health prober asks.

A text longer than the context length times the vocabulary's longest token cannot fit whatever its
tokens and is refused before it is tokenized; a shorter one is tokenized off the front's event loop
and then refused for its length. Either way every answer is INVALID_ARGUMENT, and health must not
wait behind them (Kubernetes' probe timeout is 1 s by default).
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections import Counter

import grpc

from tandem.bench.common import percentile
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

SIZES = (4_000_000, 1_000_000, 256_000, 64_000)  # UTF-8 bytes, cycled (4 MiB is the message limit)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "über", "λόγος", "数据", "42")


def _text(size: int, rng: random.Random) -> str:
    """Words, some of them multi-byte, up to `size` bytes of UTF-8."""
    words, n = [], 0
    while True:
        w = rng.choice(WORDS)
        n += len(w.encode()) + 1
        if n > size:
            return " ".join(words)
        words.append(w)


def run_senders(address: str, senders: int, seconds: float, out: object) -> None:
    """Process entry point: `senders` threads sending big prompts for `seconds`; puts the summary."""
    rng = random.Random(0)
    texts = [_text(n, rng) for n in SIZES]
    counts: Counter[str] = Counter()
    latencies: dict[int, list[float]] = {n: [] for n in SIZES}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    options = [("grpc.max_send_message_length", 8 * 1024 * 1024)]

    def send(i: int) -> None:
        with grpc.insecure_channel(address, options=options) as channel:
            stub = pb_grpc.TandemStub(channel)
            k = i
            while time.monotonic() < stop_at:
                size = SIZES[k % len(SIZES)]
                start = time.perf_counter()
                try:
                    stub.Generate(pb.GenerateRequest(text=texts[k % len(SIZES)]), timeout=60)
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                with lock:
                    counts[code] += 1
                    latencies[size].append(time.perf_counter() - start)
                k += 1

    threads = [threading.Thread(target=send, args=(i,)) for i in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(
        {
            "senders": senders,
            "seconds": seconds,
            "statuses": dict(counts),
            "answer_ms_p50_by_bytes": {
                str(n): round(1e3 * percentile(v, 50), 1) if v else None for n, v in latencies.items()
            },
        }
    )


def big_prompt_phase(address: str, senders: int, seconds: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=run_senders, args=(address, senders, seconds, out))
    proc.start()
    result = out.get(timeout=seconds + 300)
    proc.join(timeout=30)
    return result
