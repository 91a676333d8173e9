"""The TLS credentials of the gRPC and HTTP ports, read again from their files when those change.

cert-manager renews a certificate by rewriting its Secret, and the kubelet swaps the files of a
Secret volume in place: grpc asks `fetch` at every new connection, which looks at the files' stat
and reloads only when one changed; the HTTP port's `ServerSSLContext` is refreshed the same way
about once a second. Connections already open keep the certificate they shook hands with. A pair
that does not load (a half-written file, a key that does not match) is logged and the last good one
stays in use.
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


def _stamp(paths: list[Path]) -> Stamp:
    stats = [os.stat(p) for p in paths]  # follows the Secret volume's symlinks
    return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)


class _WatchedFiles:
    """A certificate, its key and an optional client CA, with the stat of the files last loaded."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._stamp: Stamp | None = None
        self.reloads = 0

    def _current_stamp(self) -> Stamp:
        return _stamp([p for p in (self.cert, self.key, self.client_ca) if p is not None])

    def _changed(self) -> bool:
        """Whether the files changed since last seen; they count as seen from now on, so that a
        bad new pair is reported once, not at every look."""
        stamp = self._current_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


class CertificateFiles(_WatchedFiles):
    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None) -> None:
        super().__init__(cert, key, client_ca)
        self.initial = self._load()  # raises InvalidCertificate: the server cannot start with them

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
            if not self._changed():
                return None
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


class ServerSSLContext(_WatchedFiles):
    """The HTTP port's TLS (1.2 or later; client certificates required under mutual TLS): one
    ssl.SSLContext, into which `refresh` loads the files again once they changed, for the
    connections that come after. A client CA can be added that way, not removed (OpenSSL's trust
    store only grows): dropping a CA from the HTTP port takes a restart."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None) -> None:
        super().__init__(cert, key, client_ca)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
        self._load()  # raises InvalidCertificate: the server cannot start with them

    def _load(self) -> None:
        stamp = self._current_stamp()
        _check(self.cert, self.key, self.client_ca)  # in a context of its own: a bad pair never gets here
        self.context.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            self.context.load_verify_locations(self.client_ca)
        self._stamp = stamp

    def refresh(self) -> None:
        try:
            if not self._changed():
                return
            self._load()
        except (OSError, InvalidCertificate, ssl.SSLError) as exc:
            log.error("TLS files changed but do not load; the HTTP port keeps its certificate: %s", exc)
            return
        self.reloads += 1
        log.info("HTTP port's TLS certificate reloaded from %s", self.cert)
