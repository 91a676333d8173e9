"""The gRPC port's TLS credentials, read again from their files when those change.

cert-manager renews a certificate by rewriting its Secret, and the kubelet swaps the files of a
Secret volume in place: grpc asks `fetch` at every new connection, which looks at the files' stat
and reloads only when one changed. Connections already open keep the certificate they shook hands
with. A pair that does not load (a half-written file, a key that does not match) is logged and the
last good one stays in use.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

Stamp = tuple[tuple[int, int, int], ...]


class InvalidCertificate(ValueError):
    pass


def _check(cert: Path, key: Path, client_ca: Path | None) -> None:
    """Raise InvalidCertificate unless the pair (and CA) load as a TLS server would load them."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
        if client_ca is not None:
            ctx.load_verify_locations(client_ca)
    except (OSError, ssl.SSLError) as exc:
        files = ", ".join(str(p) for p in (cert, key, client_ca) if p is not None)
        raise InvalidCertificate(f"TLS files {files}: {exc}") from exc


class CertificateFiles:
    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._stamp: Stamp | None = None
        self.reloads = 0
        self.initial = self._load()  # raises InvalidCertificate: the server cannot start with them

    @property
    def _paths(self) -> list[Path]:
        return [p for p in (self.cert, self.key, self.client_ca) if p is not None]

    def _current_stamp(self) -> Stamp:
        stats = [os.stat(p) for p in self._paths]  # follows the Secret volume's symlinks
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        stamp = self._current_stamp()
        _check(self.cert, self.key, self.client_ca)
        config = grpc.ssl_server_certificate_configuration(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca else None,
        )
        self._stamp = stamp
        return config

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher: a new configuration when the files changed, else None (keep the current)."""
        try:
            stamp = self._current_stamp()
            if stamp == self._stamp:
                return None
            self._stamp = stamp  # a bad new pair is reported once, not at every connection
            config = self._load()
        except (OSError, InvalidCertificate) as exc:
            log.error("TLS files changed but do not load; keeping the previous certificate: %s", exc)
            return None
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cert)
        return config

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=self.client_ca is not None
        )
