"""`tandem tokenizer`: fetch the served model's tokenizer files from a server's HTTP API into a folder,
so that `AutoTokenizer.from_pretrained(folder)` (and tools built on it: guidellm `--processor`,
inference-perf) count tokens as the server does. Standard library only: it runs from the slim image.
"""

from __future__ import annotations

import json
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from tandem import connect

TIMEOUT_S = 60.0


class FetchError(RuntimeError):
    pass


class Server:
    """The server's HTTP API at `url` (http://host:8000), with a bearer token and TLS when given."""

    def __init__(
        self,
        url: str,
        token_file: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.headers = dict(connect.token_metadata(token_file))
        self.context: ssl.SSLContext | None = None
        if ca_file is not None:
            self.context = ssl.create_default_context(cafile=ca_file)
            if cert_file is not None:
                self.context.load_cert_chain(cert_file, key_file)
        elif cert_file or key_file:
            raise ValueError("a client certificate needs the server's CA (--tls-ca-file) as well")

    def get(self, path: str) -> bytes:
        request = urllib.request.Request(self.url + path, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                why = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = body.decode(errors="replace")[:200]
            raise FetchError(f"GET {path}: {exc.code} {why}") from exc
        except urllib.error.URLError as exc:
            raise FetchError(f"cannot reach {self.url}: {exc.reason}") from exc


def _card(server: Server, model: str | None) -> dict:
    cards = json.loads(server.get("/v1/models"))["data"]
    if model is not None:
        cards = [c for c in cards if c["id"] == model]
        if not cards:
            raise FetchError(f"model {model!r} is not served at {server.url}")
    if not cards:
        raise FetchError(f"{server.url} serves no model")
    if "tokenizer" not in cards[0]:
        raise FetchError(f"{server.url} does not say where its tokenizer files are")
    return cards[0]


def _safe(name: str) -> PurePosixPath:
    """A file name the server listed, as a relative path that stays inside the folder."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")):
        raise FetchError(f"the server listed a tokenizer file {name!r} that is no plain relative path")
    return path


def fetch_tokenizer(server: Server, folder: Path, model: str | None = None) -> list[Path]:
    """Write the served model's tokenizer files into `folder`; returns the files written."""
    tokenizer = _card(server, model)["tokenizer"]
    names = [(_safe(name), name) for name in tokenizer["files"]]
    written = []
    for path, name in names:
        data = server.get(f"{tokenizer['url']}/{quote(name)}")
        target = folder.joinpath(*path.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        written.append(target)
    return written


def run(url: str, folder: str, model: str | None, token_file: str | None, ca_file: str | None,
        cert_file: str | None, key_file: str | None) -> int:  # fmt: skip
    try:
        server = Server(url, token_file, ca_file, cert_file, key_file)
        written = fetch_tokenizer(server, Path(folder), model)
    except (FetchError, OSError, ValueError, ssl.SSLError) as exc:
        print(f"tandem tokenizer: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
