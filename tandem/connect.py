"""How Tandem's own clients (`tandem generate`, `tandem health`, benchmarks) reach a server: plaintext or
TLS (with a client certificate for mutual TLS), and the bearer token as call metadata."""

from __future__ import annotations

from pathlib import Path

import grpc


def credentials(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `ca_file` (None = plaintext); cert/key: the client's, for mutual TLS."""
    if ca_file is None:
        if cert_file or key_file:
            raise ValueError("a client certificate needs the server's CA (--tls-ca-file) as well")
        return None
    if (cert_file is None) != (key_file is None):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes(),
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None,
    )


def token_metadata(token_file: str | None) -> tuple[tuple[str, str], ...]:
    """`authorization: Bearer <token>` from the file's first token line; () without a file."""
    if token_file is None:
        return ()
    lines = (line.strip() for line in Path(token_file).read_text().splitlines())
    token = next((line for line in lines if line and not line.startswith("#")), None)
    if token is None:
        raise ValueError(f"{token_file} holds no token")
    return (("authorization", f"Bearer {token}"),)


def server_name_option(name: str | None) -> list[tuple[str, object]]:
    """Check the server's certificate for `name` instead of the target's host (e.g. a port-forward)."""
    return [("grpc.ssl_target_name_override", name)] if name else []


def aio_channel(
    target: str, creds: grpc.ChannelCredentials | None, options: list[tuple[str, object]] | None = None
) -> grpc.aio.Channel:
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, creds, options=options)


def channel(
    target: str, creds: grpc.ChannelCredentials | None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)
