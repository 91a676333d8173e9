"""Run a real `tandem serve` process on loopback for tests, and wait until it is SERVING."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tandem.health import wait_serving
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

# The session's shared server (conftest.tiny_server): the tiny llama under this name, with this many
# KV blocks, every other setting the default. Modules that need nothing else talk to it.
TINY_SERVER_MODEL = "tiny-llama"
TINY_SERVER_KV_BLOCKS = 256


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
