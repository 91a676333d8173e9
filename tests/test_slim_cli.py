"""The CLI as the slim operator image runs it (no torch, transformers, gguf, accelerate): `tandem health`,
the check `helm test` runs, against a real `tandem serve` and a NOT_SERVING server; `tandem generate`,
the client docs/install.md runs in the cluster from that image; `tandem tokenizer`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from serverproc import free_port

# Runs `tandem health` with the model-serving libraries made unimportable, as in the slim operator image.
WITHOUT_ENGINE = (
    "import sys\n"
    "for name in ('torch', 'transformers', 'gguf', 'accelerate'):\n"
    "    sys.modules[name] = None\n"
    "from tandem.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def tandem_health(*args: str) -> subprocess.CompletedProcess:
    return slim_tandem("health", *args)


def slim_tandem(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_ENGINE, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=60,
    )


@pytest.fixture(scope="module")
def server(tiny_server: str) -> str:
    return tiny_server  # conftest's: the tiny llama


@pytest.fixture()
def not_serving() -> Iterator[str]:
    """A gRPC server whose health service (grpcio's own) says NOT_SERVING, as a draining pod's does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_serving_server_passes(server: str) -> None:
    result = tandem_health("--target", server, "--timeout", "10")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{server}: SERVING"


def test_named_service_of_a_serving_server_passes(server: str) -> None:
    result = tandem_health("--target", server, "--service", "tandem.v1.Tandem")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("tandem.v1.Tandem: SERVING")


def test_unknown_service_fails(server: str) -> None:
    result = tandem_health("--target", server, "--service", "no.such.Service")
    assert result.returncode == 1
    assert result.stdout.strip().endswith("NOT_FOUND")


def test_not_serving_fails(not_serving: str) -> None:
    result = tandem_health("--target", not_serving, "--timeout", "5")
    assert result.returncode == 1
    assert result.stdout.strip() == f"{not_serving}: NOT_SERVING"


def test_nothing_listening_fails_after_the_timeout() -> None:
    target = f"127.0.0.1:{free_port()}"
    result = tandem_health("--target", target, "--timeout", "1")
    assert result.returncode == 1
    assert result.stdout.strip() == f"{target}: DEADLINE_EXCEEDED"


def test_generate_streams_without_the_model_stack(server: str) -> None:
    result = slim_tandem("generate", "--server", server, "--raw", "Once upon a time", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "some text came back"
    assert "completion tokens]" in result.stderr


def test_tokenizer_fetches_without_the_model_stack(tiny_server_http: str, tmp_path) -> None:
    result = slim_tandem("tokenizer", str(tmp_path / "tok"), "--server", tiny_server_http)
    assert result.returncode == 0, result.stderr
    written = result.stdout.split()
    assert str(tmp_path / "tok" / "tokenizer.json") in written and all(Path(f).is_file() for f in written)
