"""TLS, mutual TLS and bearer tokens on a real `tandem serve`, asked by real clients (grpc stubs,
tritonclient, the openai client on the HTTP port); certificates and tokens rotated on disk while it
runs, as cert-manager and a Secret volume rotate them.

One server serves the module: TLS with a client CA (mutual TLS), a token file, the plaintext
health port, the OpenAI HTTP port, reflection off. The rotation tests come last: they change the
files it reads.
"""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as tc
from certs import CertificateAuthority, Issued
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serverproc import LiveServer, ServerFactory
from tritonclient.utils import InferenceServerException

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MODEL_NAME = "tiny-tls"
TOKEN = "tok-3f9c2a7d1e"
TIMEOUT = 30.0
FRESH = [("grpc.use_local_subchannel_pool", 1)]  # every channel its own connection (a new handshake)


@dataclass
class Pki:
    folder: Path
    server_ca: CertificateAuthority
    client_ca: CertificateAuthority
    client: Issued
    cert: Path
    key: Path
    client_ca_file: Path
    tokens: Path

    def credentials(self, ca: bytes | None = None, client: Issued | None = None) -> grpc.ChannelCredentials:
        client = self.client if client is None else client
        return grpc.ssl_channel_credentials(
            ca or self.server_ca.cert, private_key=client.key, certificate_chain=client.cert
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    server_ca, client_ca = CertificateAuthority("server-ca"), CertificateAuthority("client-ca")
    cert, key = server_ca.issue("tandem", server=True).write(folder, "server")
    (folder / "client-ca.crt").write_bytes(client_ca.cert)
    (folder / "tokens").write_text(f"# accepted tokens\n\n{TOKEN}\n")
    client = client_ca.issue("a-client", server=False)
    return Pki(folder, server_ca, client_ca, client, cert, key, folder / "client-ca.crt", folder / "tokens")


@pytest.fixture(scope="module")
def live(serve: ServerFactory, pki: Pki) -> LiveServer:
    return serve(
        "--model-name", MODEL_NAME,
        "--tls-cert-file", str(pki.cert),
        "--tls-key-file", str(pki.key),
        "--tls-client-ca-file", str(pki.client_ca_file),
        "--auth-token-file", str(pki.tokens),
        "--no-reflection",
        http=True,
        health=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(live: LiveServer) -> tuple[str, int]:
    return live.address, live.health_port


@pytest.fixture(scope="module")
def http_port(live: LiveServer) -> int:
    return live.http_port


def _token(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _generate(channel: grpc.Channel, metadata: tuple = ()) -> pb.GenerateResponse:
    req = pb.GenerateRequest(text="Once upon a time", stopping=pb.StoppingCriteria(max_tokens=4))
    return pb_grpc.TandemStub(channel).Generate(req, timeout=TIMEOUT, metadata=metadata)


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_authenticated_client_over_mutual_tls(server: tuple[str, int], pki: Pki) -> None:
    with grpc.secure_channel(server[0], pki.credentials(), options=FRESH) as channel:
        reply = _generate(channel, _token())
        assert reply.usage.completion_tokens == 4 and reply.finish_reason
        streamed = pb_grpc.TandemStub(channel).GenerateStream(
            pb.GenerateRequest(text="Once upon a time", stopping=pb.StoppingCriteria(max_tokens=4)),
            timeout=TIMEOUT,
            metadata=_token(),
        )
        assert "".join(m.text for m in streamed) == reply.text


def test_plaintext_and_foreign_certificates_cannot_connect(server: tuple[str, int], pki: Pki) -> None:
    address = server[0]
    with grpc.insecure_channel(address, options=FRESH) as channel:
        assert _code(lambda: _generate(channel, _token())) == grpc.StatusCode.UNAVAILABLE
    stranger = CertificateAuthority("elsewhere")
    cases = {
        "no client certificate": grpc.ssl_channel_credentials(pki.server_ca.cert),
        "a client certificate the client CA did not sign": pki.credentials(
            client=stranger.issue("intruder", server=False)
        ),
        "a server CA the client does not trust": pki.credentials(ca=stranger.cert),
    }
    for why, creds in cases.items():
        with grpc.secure_channel(address, creds, options=FRESH) as channel:
            assert _code(lambda c=channel: _generate(c, _token())) == grpc.StatusCode.UNAVAILABLE, why


def test_calls_without_a_valid_token_are_unauthenticated(server: tuple[str, int], pki: Pki) -> None:
    with grpc.secure_channel(server[0], pki.credentials(), options=FRESH) as channel:
        stub = pb_grpc.TandemStub(channel)
        for metadata in ((), _token("wrong"), (("authorization", TOKEN),), (("authorization", "Bearer "),)):
            assert _code(lambda md=metadata: _generate(channel, md)) == grpc.StatusCode.UNAUTHENTICATED
            stream = stub.GenerateStream(pb.GenerateRequest(text="x"), timeout=TIMEOUT, metadata=metadata)
            assert _code(lambda s=stream: list(s)) == grpc.StatusCode.UNAUTHENTICATED
            info = stub.GetModelInfo
            assert _code(lambda md=metadata, f=info: f(pb.ModelInfoRequest(), metadata=md)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
        # the scheme is case-insensitive, as HTTP's
        assert _generate(channel, (("authorization", f"bearer {TOKEN}"),)).usage.completion_tokens == 4


def _triton(address: str, pki: Pki) -> tc.InferenceServerClient:
    folder = pki.folder
    (folder / "client.crt").write_bytes(pki.client.cert)
    (folder / "client.key").write_bytes(pki.client.key)
    (folder / "server-ca.crt").write_bytes(pki.server_ca.cert)
    return tc.InferenceServerClient(
        url=address,
        ssl=True,
        root_certificates=str(folder / "server-ca.crt"),
        private_key=str(folder / "client.key"),
        certificate_chain=str(folder / "client.crt"),
    )


def test_kserve_needs_the_token_too(server: tuple[str, int], pki: Pki) -> None:
    client = _triton(server[0], pki)
    text = tc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Once upon a time"], dtype=np.object_))
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL_NAME, [text], client_timeout=TIMEOUT)
    assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as err:
        client.is_server_ready(headers={"authorization": "Bearer wrong"})
    assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    headers = {"authorization": f"Bearer {TOKEN}"}
    assert client.is_server_ready(headers=headers)
    result = client.infer(MODEL_NAME, [text], headers=headers, client_timeout=TIMEOUT)
    assert result.as_numpy("text_output")[0]
    client.close()


def test_health_needs_no_token_and_the_health_port_serves_only_health(
    server: tuple[str, int], pki: Pki
) -> None:
    address, health_port = server
    check = health_pb2.HealthCheckRequest()
    with grpc.secure_channel(address, pki.credentials(), options=FRESH) as channel:
        assert health_pb2_grpc.HealthStub(channel).Check(check, timeout=TIMEOUT).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
    with grpc.insecure_channel(f"127.0.0.1:{health_port}", options=FRESH) as channel:
        assert health_pb2_grpc.HealthStub(channel).Check(check, timeout=TIMEOUT).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        assert _code(lambda: _generate(channel, _token())) == grpc.StatusCode.UNIMPLEMENTED
    ok = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "health", "--target", f"127.0.0.1:{health_port}"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    (pki.folder / "server-ca.crt").write_bytes(pki.server_ca.cert)
    over_tls = [sys.executable, "-m", "tandem.cli", "health", "--target", address]
    (pki.folder / "client.crt").write_bytes(pki.client.cert)
    (pki.folder / "client.key").write_bytes(pki.client.key)
    over_tls += ["--tls-ca-file", str(pki.folder / "server-ca.crt")]
    over_tls += [
        "--tls-cert-file",
        str(pki.folder / "client.crt"),
        "--tls-key-file",
        str(pki.folder / "client.key"),
    ]
    ok = subprocess.run(over_tls, capture_output=True, text=True)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
    # the certificate is checked for the name given, not the target's address
    over_tls += ["--tls-server-name", "elsewhere.example", "--timeout", "3"]
    wrong = subprocess.run(over_tls, capture_output=True, text=True)
    assert wrong.returncode == 1 and "DEADLINE_EXCEEDED" in wrong.stdout, wrong.stdout + wrong.stderr


def _https(pki: Pki, ca: bytes | None = None, client: bool = True) -> ssl.SSLContext:
    """A client's TLS context: trusting `ca` (the server CA), with the client certificate or none."""
    ctx = ssl.create_default_context(cadata=(ca or pki.server_ca.cert).decode())
    if client:
        (pki.folder / "client.crt").write_bytes(pki.client.cert)
        (pki.folder / "client.key").write_bytes(pki.client.key)
        ctx.load_cert_chain(pki.folder / "client.crt", pki.folder / "client.key")
    return ctx


def _http(
    port: int, ctx: ssl.SSLContext, method: str, path: str, headers: dict | None = None
) -> tuple[int, dict]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=TIMEOUT, context=ctx)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 3}) if method == "POST" else None
    conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    return resp.status, answer


def test_the_http_port_speaks_mutual_tls_and_needs_the_token(
    server: tuple[str, int], pki: Pki, http_port: int
):
    ctx = _https(pki)
    with openai.OpenAI(
        base_url=f"https://127.0.0.1:{http_port}/v1", api_key=TOKEN, max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=ctx),
    ) as client:  # fmt: skip
        answer = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4)
        assert answer.usage.completion_tokens == 4
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method, path in (
            ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_NAME}/tokenizer"),
            ("GET", f"/v1/models/{MODEL_NAME}/tokenizer/tokenizer.json"),
        ):  # fmt: skip
            status, answer = _http(http_port, ctx, method, path, headers)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key", (headers, answer)
    assert _http(http_port, ctx, "GET", "/v1/models", bearer)[1]["data"][0]["id"] == MODEL_NAME
    assert _http(http_port, ctx, "GET", "/ready") == (200, {"status": "ready"})  # probes need no token
    assert _http(http_port, ctx, "GET", "/health")[0] == 200
    # no client certificate, or plaintext: no answer at all
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _http(http_port, _https(pki, client=False), "GET", "/health")
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain = http.client.HTTPConnection("127.0.0.1", http_port, timeout=TIMEOUT)
        plain.request("GET", "/health")
        plain.getresponse()


def test_reflection_can_be_turned_off(server: tuple[str, int], pki: Pki) -> None:
    with grpc.secure_channel(server[0], pki.credentials(), options=FRESH) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
            timeout=TIMEOUT,
            metadata=_token(),
        )
        assert _code(lambda: list(replies)) == grpc.StatusCode.UNIMPLEMENTED


def test_generate_cli_over_mutual_tls_with_a_token(server: tuple[str, int], pki: Pki) -> None:
    folder = pki.folder
    (folder / "server-ca.crt").write_bytes(pki.server_ca.cert)
    (folder / "client.crt").write_bytes(pki.client.cert)
    (folder / "client.key").write_bytes(pki.client.key)
    cmd = [sys.executable, "-m", "tandem.cli", "generate", "Hello", "--raw", "--max-tokens", "3"]
    cmd += ["--server", server[0], "--tls-ca-file", str(folder / "server-ca.crt")]
    cmd += ["--tls-cert-file", str(folder / "client.crt"), "--tls-key-file", str(folder / "client.key")]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    answered = subprocess.run(
        [*cmd, "--token-file", str(pki.tokens)], capture_output=True, text=True, timeout=60
    )
    assert answered.returncode == 0, answered.stderr
    assert "3 completion tokens" in answered.stderr
    assert TOKEN not in answered.stdout + answered.stderr


def test_tokenizer_cli_over_mutual_tls_with_a_token(server: tuple[str, int], pki: Pki, http_port: int):
    from transformers import AutoTokenizer

    folder, out = pki.folder, pki.folder / "fetched-tokenizer"
    (folder / "server-ca.crt").write_bytes(pki.server_ca.cert)
    (folder / "client.crt").write_bytes(pki.client.cert)
    (folder / "client.key").write_bytes(pki.client.key)
    cmd = [sys.executable, "-m", "tandem.cli", "tokenizer", str(out), "--server", f"https://127.0.0.1:{http_port}"]
    cmd += ["--tls-ca-file", str(folder / "server-ca.crt")]
    cmd += ["--tls-cert-file", str(folder / "client.crt"), "--tls-key-file", str(folder / "client.key")]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "401 missing bearer token" in refused.stderr
    assert not out.exists()
    cmd += ["--token-file", str(pki.tokens)]
    fetched = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert fetched.returncode == 0, fetched.stderr
    assert TOKEN not in fetched.stdout + fetched.stderr
    assert (out / "tokenizer.json").is_file()
    assert AutoTokenizer.from_pretrained(out).encode("Once upon a time")


def test_token_file_is_read_again_when_it_changes(server: tuple[str, int], pki: Pki) -> None:
    with grpc.secure_channel(server[0], pki.credentials(), options=FRESH) as channel:
        _rotate_tokens(pki, "tok-rotated")
        _until_accepted(channel, "tok-rotated")
        assert _code(lambda: _generate(channel, _token())) == grpc.StatusCode.UNAUTHENTICATED  # revoked
        _rotate_tokens(pki, TOKEN)
        _until_accepted(channel, TOKEN)


def _rotate_tokens(pki: Pki, token: str) -> None:
    replacement = pki.folder / "tokens.new"
    replacement.write_text(f"{token}\n")
    replacement.replace(pki.tokens)  # atomically, as the kubelet swaps a Secret volume's files


def _until_accepted(channel: grpc.Channel, token: str) -> None:
    """The server looks at the file at most once a second: the new token is accepted soon after."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            _generate(channel, _token(token))
            return
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            time.sleep(0.2)
    pytest.fail(f"the token {token!r} was never accepted")


def test_certificate_rotation_reaches_new_connections(
    server: tuple[str, int], pki: Pki, http_port: int
) -> None:
    address = server[0]
    old_ca = pki.server_ca.cert
    kept = grpc.secure_channel(address, pki.credentials(ca=old_ca), options=FRESH)
    assert _generate(kept, _token()).usage.completion_tokens == 4  # a connection made before the change

    # a broken rewrite (cert and key that do not match) is refused: the old certificate stays in use
    shutil.copy(pki.key, pki.folder / "old.key")
    other = CertificateAuthority("renewed-ca")
    renewed = other.issue("tandem", server=True)
    pki.cert.write_bytes(renewed.cert)  # the key is not written yet
    with grpc.secure_channel(address, pki.credentials(ca=old_ca), options=FRESH) as channel:
        assert _generate(channel, _token()).usage.completion_tokens == 4

    pki.key.write_bytes(renewed.key)  # now the pair is whole: new connections get the new certificate
    with grpc.secure_channel(address, pki.credentials(ca=other.cert), options=FRESH) as channel:
        assert _generate(channel, _token()).usage.completion_tokens == 4
    with grpc.secure_channel(address, pki.credentials(ca=old_ca), options=FRESH) as channel:
        assert _code(lambda: _generate(channel, _token())) == grpc.StatusCode.UNAVAILABLE
    assert _generate(kept, _token()).usage.completion_tokens == 4  # open connections are not cut
    kept.close()
    # the HTTP port looks at the files about once a second: soon its new connections get it too
    deadline = time.monotonic() + 10
    while True:
        try:
            assert _http(http_port, _https(pki, ca=other.cert), "GET", "/health")[0] == 200
            break
        except ssl.SSLError:
            assert time.monotonic() < deadline, "the HTTP port never served the renewed certificate"
            time.sleep(0.2)
    with pytest.raises(ssl.SSLError):
        _http(http_port, _https(pki, ca=old_ca), "GET", "/health")


def serve_command(*args: str) -> list[str]:
    """`tandem serve` on ports it picks itself (HTTP off), with `args`: for settings that stop the start."""
    return [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        *args,
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--tls-cert-file", "/nonexistent/tls.crt", "--tls-key-file", "/nonexistent/tls.key"],
            "No such file",
        ),
        (["--tls-cert-file", "/etc/hostname"], "tls_cert_file and tls_key_file go together"),
        (["--auth-token-file", "/nonexistent/tokens"], "No such file"),
    ],
)
def test_bad_security_settings_stop_the_start(args: list[str], message: str, tmp_path: Path) -> None:
    done = subprocess.run(serve_command(*args), capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode != 0
    assert message in done.stderr


def test_an_empty_token_file_stops_the_start(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("# nobody yet\n\n")
    done = subprocess.run(
        serve_command("--auth-token-file", str(tmp_path / "tokens")),
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert done.returncode == 1 and "holds no token" in done.stderr
