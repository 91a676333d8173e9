"""Run real `tandem serve` processes on loopback for tests, and wait until they are SERVING.

`ServerFactory` is what test modules use (conftest's `serve` and `shared_servers` fixtures): it
starts a server for a set of settings and stops it when its scope ends. `running_server` is the
one process underneath.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tandem.health import wait_serving
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

# The session's shared server (conftest.tiny_server): the tiny llama under this name, with this many
# KV blocks, every other setting the default. Modules that need nothing else talk to it.
TINY_SERVER_MODEL = "tiny-llama"
TINY_SERVER_KV_BLOCKS = 256
TINY_SERVER_FLAGS = ("--model-name", TINY_SERVER_MODEL, "--num-kv-blocks", str(TINY_SERVER_KV_BLOCKS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(
    model: Path | None,
    *extra: str,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    health_port: int | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (address, process). `model` None = the embedded default model; `env`: added variables;
    `health_port`: serve plaintext health there and wait on it (the way to wait on a TLS server).

    The metrics endpoint and the HTTP API are off unless `extra` sets --metrics-port / --http-port
    (9400 and 8000 would clash between servers); the KV cache is 0.25 GiB unless `extra` sizes it.
    """
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        *extra,
    ]
    if model is not None:
        cmd += ["--model", str(model)]
    if health_port is not None:
        cmd += ["--health-port", str(health_port)]
    for flag in ("--metrics-port", "--http-port"):
        if flag not in extra:
            cmd += [flag, "0"]
    if "--num-kv-blocks" not in extra and "--kv-cache-cpu-gib" not in extra:
        cmd += ["--kv-cache-cpu-gib", "0.25"]  # the 2 GiB default takes seconds to zero at every start
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    env = {**os.environ, **(env or {}), "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/")
    address = f"127.0.0.1:{port}"
    try:
        waited = address if health_port is None else f"127.0.0.1:{health_port}"
        wait_serving(waited, 180.0, lambda: proc.poll() is None)
        yield address, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            out.close()


def wait_idle(stub: pb_grpc.TandemStub, timeout: float = 5.0) -> pb.Load:
    """Poll GetLoad until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(pb.LoadRequest(), timeout=60.0)
        idle = load.requests_running == 0 and load.requests_waiting == 0
        if idle and load.kv_blocks_free == load.kv_blocks_total:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle {timeout} s after the last request: {load}")
        time.sleep(0.05)


def pod_pids(log: Path) -> tuple[int, list[int]]:
    """(engine, fronts) from the supervisor's start-up line in a server's log."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"engine process (\d+), front process\(es\) ([\d, ]+) on port", log.read_text())
        if found:
            return int(found.group(1)), [int(p) for p in found.group(2).split(", ")]
        time.sleep(0.1)
    raise AssertionError(f"no process ids in {log}")


def peer_ports(pid: int, port: int) -> set[int]:
    """Remote ports of the established TCP connections process `pid` holds on local `port`."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    peers = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            local, remote, state, inode = f[1], f[2], f[3], f[9]
            if state == "01" and inode in inodes and int(local.rsplit(":", 1)[1], 16) == port:
                peers.add(int(remote.rsplit(":", 1)[1], 16))
    return peers


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running, or not yet reaped by anyone (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of `pids` runs; returns those still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@dataclass(frozen=True)
class ServerSpec:
    """Everything that tells two test servers apart; a factory's shared servers are keyed by it.
    Ports are not part of it: the factory picks free ones at each start."""

    flags: tuple[str, ...] = ()
    model: str | None = "llama"  # a family of conftest.tiny_model_dir; None: the embedded default model
    env: tuple[tuple[str, str], ...] = ()  # variables added to the server's environment
    http: bool = False  # the OpenAI HTTP API on a port of its own
    metrics: bool = False  # /metrics on a port of its own
    health: bool = False  # plaintext health on a port of its own, waited on (the way to wait on TLS)


@dataclass(frozen=True)
class LiveServer:
    """A started `tandem serve`: where to reach it, its supervisor process and its log."""

    address: str  # gRPC, 127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path
    http_port: int | None = None
    metrics_port: int | None = None
    health_port: int | None = None

    @property
    def http_url(self) -> str:
        """The OpenAI HTTP API's base URL, http://127.0.0.1:PORT (without /v1)."""
        assert self.http_port is not None, "started without http=True"
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        assert self.metrics_port is not None, "started without metrics=True"
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class ServerFactory:
    """`factory(*flags, **settings)` starts a `tandem serve` that runs until the factory closes;
    `factory.started(*flags, **settings)` one for a `with` block (a test that stops or kills its
    server). The settings are ServerSpec's (`env` a mapping). `shared=True` asks `shared_with` (or
    this factory) for the one server of those settings, started by the first to ask and kept until
    it closes: only for tests that change nothing another user could see (counters, cache
    contents, the files it reads), and that assert nothing on such things themselves."""

    def __init__(
        self,
        model_dir: Callable[[str], Path],
        folder: Callable[[], Path],
        shared_with: ServerFactory | None = None,
    ) -> None:
        self._model_dir, self._folder, self._shared_with = model_dir, folder, shared_with
        self._stack = contextlib.ExitStack()
        self._kept: dict[ServerSpec, LiveServer] = {}

    def __enter__(self) -> ServerFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __call__(
        self,
        *flags: str,
        model: str | None = "llama",
        env: Mapping[str, str] | None = None,
        http: bool = False,
        metrics: bool = False,
        health: bool = False,
        shared: bool = False,
    ) -> LiveServer:
        spec = ServerSpec(flags, model, tuple(sorted((env or {}).items())), http, metrics, health)
        if not shared:
            return self._stack.enter_context(self._run(spec))
        keeper = self._shared_with or self
        if spec not in keeper._kept:
            keeper._kept[spec] = keeper._stack.enter_context(keeper._run(spec))
        return keeper._kept[spec]

    def started(
        self,
        *flags: str,
        model: str | None = "llama",
        env: Mapping[str, str] | None = None,
        http: bool = False,
        metrics: bool = False,
        health: bool = False,
    ) -> contextlib.AbstractContextManager[LiveServer]:
        return self._run(ServerSpec(flags, model, tuple(sorted((env or {}).items())), http, metrics, health))

    @contextlib.contextmanager
    def _run(self, spec: ServerSpec) -> Iterator[LiveServer]:
        http, metrics, health = (free_port() if on else None for on in (spec.http, spec.metrics, spec.health))
        flags = list(spec.flags)
        if http is not None:
            flags += ["--http-port", str(http)]
        if metrics is not None:
            flags += ["--metrics-port", str(metrics)]
        model = None if spec.model is None else self._model_dir(spec.model)
        log = self._folder() / "server.log"
        with running_server(model, *flags, log=log, env=dict(spec.env), health_port=health) as started:
            yield LiveServer(*started, log, http, metrics, health)
