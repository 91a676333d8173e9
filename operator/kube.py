"""A small Kubernetes API client for the handlers' own calls, on the credentials kopf logs in with.

kopf has no public client for arbitrary objects; this one does JSON over aiohttp (kopf's own
HTTP library): get, list, create, merge- and JSON-patch, delete, on the ConnectionInfo of the login handler.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf


class NotFound(Exception):
    pass


class NotLeading(Exception):
    """A write refused locally: this replica does not hold the leader Lease (leader.py)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def api_path(api_version: str, plural: str, namespace: str | None, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
    return f"{path}/{name}" if name else path


def _pem(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    ca_data = _pem(info.ca_data).decode() if info.ca_data else None
    context = ssl.create_default_context(cafile=info.ca_path, cadata=ca_data)
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data or info.private_key_data:
        # ssl loads client certificates from files only
        files = []
        for data in (info.certificate_data, info.private_key_data):
            f = tempfile.NamedTemporaryFile(suffix=".pem")  # noqa: SIM115 (kept open until loaded)
            f.write(_pem(data) if data else b"")
            f.flush()
            files.append(f)
        cert, key = files[0].name, files[1].name if info.private_key_data else None
        context.load_cert_chain(cert, key)
        for f in files:
            f.close()
    elif cert:
        context.load_cert_chain(cert, key)
    return context


class KubeApi:
    def __init__(self, info: kopf.ConnectionInfo, may_write: Callable[[], bool] | None = None) -> None:
        # asked before every write: a replica that lost the leader Lease writes nothing more
        self.may_write = may_write
        self.server = info.server.rstrip("/")
        self.headers = {"Accept": "application/json"}
        if info.token:
            self.headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username:
            auth = base64.b64encode(f"{info.username}:{info.password or ''}".encode()).decode()
            self.headers["Authorization"] = f"Basic {auth}"
        self.ssl = _ssl_context(info)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=30), trust_env=False
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict | None = None,
        content_type: str | None = None,
        timeout: float | None = None,
    ) -> dict:
        if method != "GET" and self.may_write is not None and not self.may_write():
            raise NotLeading(f"{method} {path}: this replica does not hold the leader Lease")
        headers = {"Content-Type": content_type or "application/json"} if body is not None else {}
        limit = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout is not None else {}
        async with self._client().request(
            method, self.server + path, json=body, params=params, headers=headers, ssl=self.ssl, **limit
        ) as response:
            if response.status == 404:
                raise NotFound(path)
            if response.status >= 400:
                raise ApiError(response.status, await response.text())
            return await response.json(content_type=None)

    async def get(self, path: str, timeout: float | None = None) -> dict:
        return await self.request("GET", path, timeout=timeout)

    async def list(self, path: str, label_selector: dict[str, str] | None = None) -> list[dict]:
        params = (
            {"labelSelector": ",".join(f"{k}={v}" for k, v in label_selector.items())}
            if label_selector
            else None
        )
        items = (await self.request("GET", path, params=params)).get("items") or []
        if label_selector:  # also here: not every API server (or emulator) filters
            items = [i for i in items if _matches(i, label_selector)]
        return items

    async def create(self, path: str, body: dict, timeout: float | None = None) -> dict:
        return await self.request("POST", path, body, timeout=timeout)

    async def put(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """An update: with metadata.resourceVersion set, refused (409) if the object changed since."""
        return await self.request("PUT", path, body, timeout=timeout)

    async def patch(self, path: str, body: dict) -> dict:
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json")

    async def json_patch(self, path: str, operations: list[dict]) -> dict:
        return await self.request("PATCH", path, operations, content_type="application/json-patch+json")

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path, {"propagationPolicy": "Background"})
        except NotFound:
            pass


def _matches(obj: dict, label_selector: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in label_selector.items())
