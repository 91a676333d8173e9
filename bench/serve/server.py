"""The server side of the benchmarks that go through `tandem serve` (bench serve, bench soak): the model
to serve, the server's settings, the `tandem serve` process itself, and its gauges while it runs.

Light at import (no torch), so that client processes, which import their parent's modules, stay small.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.common import SHAPES, percentile

# the benchmark shapes with the 49,152-token vocabulary of the tokenizer they are served with (SmolLM2's)
VOCAB = {"tiny": 512, "1b": 49152, "8b": 49152}


# -- the model ---------------------------------------------------------------------------------------


def default_tokenizer() -> Path:
    from tandem.service.models.default_model import default_gguf_path
    from tandem.service.models.loader import convert_gguf, default_cache_dir

    return convert_gguf(default_gguf_path(), default_cache_dir())


def make_model(shape: str, tokenizer_dir: Path, folder: Path, device: str, vocab: int | None = None) -> Path:
    """A random-initialised Llama of `shape` saved as a transformers directory, with a real tokenizer.

    `vocab`: the vocabulary size (default: the shape's, VOCAB); text prompts need the tokenizer's."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vocab = vocab or VOCAB[shape]
    target = folder / (f"llama-{shape}" if vocab == VOCAB[shape] else f"llama-{shape}-v{vocab}")
    if (target / "config.json").is_file():
        return target
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        **{**SHAPES[shape], "vocab_size": vocab},
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the server and the engine alone get the whole device
    return target


def tokenizer_size(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer_dir))


def model_limits(model_dir: Path | None, server: str | None) -> tuple[int, int]:
    """(vocabulary, context length) of the model, for prompts of valid ids that fit."""
    if server is not None:
        import grpc

        from tandem.v1 import tandem_pb2 as pb
        from tandem.v1 import tandem_pb2_grpc as pb_grpc

        with grpc.insecure_channel(server) as channel:
            info = pb_grpc.TandemStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=30)
        return info.vocab_size, info.max_context_length
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    return text["vocab_size"], text.get("max_position_embeddings", 2048)


# -- options and settings ------------------------------------------------------------------------


def add_model_options(ap: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """--shape / --model (the returned group, for more choices), --tokenizer, --device, --set."""
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--shape", choices=sorted(SHAPES), help="a random-initialised Llama of this shape")
    where.add_argument("--model", help="a transformers model directory (or .gguf file) to serve")
    ap.add_argument(
        "--tokenizer", help="with --shape: the tokenizer directory (default: the embedded model's)"
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a server setting, as TANDEM_NAME in the server's environment (repeatable; NAME= unsets it)",
    )
    # the server's settings of these names, spelled as `tandem serve` spells them; after --set, so
    # they win over it
    ap.add_argument("--quantization", choices=["none", "fp8"], default=None,
                    help="linear layers in FP8 (fp8) or as the checkpoint is (none); default: the server's")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                    help="the KV cache in the model's dtype (auto) or FP8; default: the server's")
    return where


def precision_sets(a: argparse.Namespace) -> list[str]:
    """--set entries of --quantization and --kv-cache-dtype (none: the setting unset)."""
    sets = []
    if a.quantization is not None:
        sets.append(f"quantization={'' if a.quantization == 'none' else a.quantization}")
    if a.kv_cache_dtype is not None:
        sets.append(f"kv_cache_dtype={a.kv_cache_dtype}")
    return sets


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def settings_env(sets: Sequence[str], device: str, **defaults: str) -> dict[str, str]:
    """The server's environment: ours, TANDEM_DEVICE, `defaults` (TANDEM_NAME=value unless set), --set."""
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TANDEM_DEVICE": device}
    env.update({f"TANDEM_{k.upper()}": v for k, v in defaults.items()})
    for item in sets:
        name, _, value = item.partition("=")
        variable = f"TANDEM_{name.upper().replace('-', '_')}"
        if value:
            env[variable] = value
        else:  # the server's default, whatever this process's environment says
            env.pop(variable, None)
    return env


def settings_of(env: dict[str, str]) -> dict[str, str]:
    """The TANDEM_ settings of an environment, for the report (the model's path is machine-local)."""
    return {k: v for k, v in env.items() if k.startswith("TANDEM_") and k != "TANDEM_MODEL"}


# -- the server process --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tls_env(folder: Path) -> dict[str, str]:
    """The server's TLS settings from a folder of ca.crt, server.crt and server.key (for 127.0.0.1)."""
    return {
        "TANDEM_TLS_CERT_FILE": str(folder / "server.crt"),
        "TANDEM_TLS_KEY_FILE": str(folder / "server.key"),
        "TANDEM_HEALTH_PORT": str(free_port()),  # a TLS port is waited on through the plaintext one
    }


@dataclass(frozen=True)
class CpuSplit:
    """The benchmark host's CPUs split between the client processes and what they load (the server
    and every process it starts, or the engine alone), so that neither side takes the other's
    cycles; empty: both share every CPU."""

    clients: tuple[int, ...] = ()
    measured: tuple[int, ...] = ()

    @classmethod
    def of(cls, client_cpus: int, cpus: Sequence[int] | None = None) -> CpuSplit:
        """The last `client_cpus` of `cpus` (this process's own by default) for the clients (0: no split)."""
        if not client_cpus:
            return cls()
        cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        if not 0 < client_cpus < len(cpus):
            raise SystemExit(f"--client-cpus {client_cpus}: this process may use {len(cpus)} CPUs; "
                             "leave at least one to the server")
        return cls(tuple(cpus[-client_cpus:]), tuple(cpus[:-client_cpus]))

    def pin_measured(self, pid: int) -> None:
        """Pin a process that has not started its children yet (they inherit its CPUs)."""
        if self.measured:
            os.sched_setaffinity(pid, self.measured)

    def pin_client(self, pid: int) -> None:
        if self.clients:
            os.sched_setaffinity(pid, self.clients)


def start_server(
    env: dict[str, str], log: Path, extra: Sequence[str] = (), cpus: CpuSplit = CpuSplit()
) -> tuple[subprocess.Popen, str, str]:
    """`tandem serve` on loopback ports of its own; (process, gRPC address, /metrics URL).

    `extra`: more `tandem serve` arguments (they beat the TANDEM_ environment). The OpenAI HTTP
    port is off unless the environment sets TANDEM_HTTP_PORT (8000 would clash between servers).
    `cpus`: the server runs on the split's measured CPUs (pinned before it starts its processes)."""
    port, metrics_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *([] if "TANDEM_HTTP_PORT" in env else ["--http-port", "0"]),
        *extra,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd="/")
    cpus.pin_measured(proc.pid)  # at once: it imports for a second before it starts any child
    return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"


def stop_server(proc: subprocess.Popen, timeout: float = 120.0) -> int | str:
    """SIGTERM (the server drains), then its exit code, or why there is none."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return f"did not stop in {timeout:.0f} s after SIGTERM"


class GaugeSampler:
    """Polls the server's /metrics while levels run: its idle fraction and how many requests run."""

    GAUGES = (
        "tandem_gpu_idle_fraction",
        "tandem_requests_running",
        "tandem_requests_waiting",
        "tandem_capacity_tokens_per_second",
        "tandem_capacity_utilization",
    )

    def __init__(self, url: str | None, period: float = 0.25) -> None:
        self.url, self.period = url, period
        self.samples: list[tuple[float, str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while not self._stop.wait(self.period):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            now = time.time()
            for family in text_string_to_metric_families(text):
                if family.name in self.GAUGES and family.samples:
                    self.samples.append((now, family.name, family.samples[0].value))

    def __enter__(self) -> GaugeSampler:
        if self.url:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def during(self, name: str, start: float, end: float) -> float | None:
        """The median reading in the middle half of [start, end] (the window has filled by then)."""
        lo, hi = start + (end - start) / 4, end - (end - start) / 4
        median = percentile([v for t, n, v in self.samples if n == name and lo <= t <= hi], 50)
        return None if median is None else round(median, 4)
