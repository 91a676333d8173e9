
"""Who may share a request's cached prefix: its cache scope, made here, opaque to the engine.

A cached prefix is a side channel: a request that finds its prompt cached runs faster, so a caller
could time whether someone else sent that prompt, and (were block names forgeable) read their K/V.
The engine shares a cached block only between requests of one scope (block_manager.py). The front
names the scope from what the caller presents: its bearer token where the server isolates tenants
(`prefix_cache_isolation=token`), and the request's own `cache_salt` (vLLM's name for it), so that
callers of one token can still keep their prefixes apart. The token itself never leaves the front:
the scope is a digest of it.
"""

from __future__ import annotations

import hashlib

from ..contract import invalid

MAX_SALT_CHARS = 256
SHARED = b""  # the scope of a request with no token to isolate and no salt


def cache_scope(token: bytes | None, salt: str | None) -> bytes:
    """The scope of a request presenting `token` (None: not isolated by token) and `salt` (None
    or empty: none): SHARED, or a SHA-256 digest of both, each part marked present or absent and
    length-prefixed, so that no two different pairs name one scope."""
    if token is None and not salt:
        return SHARED
    digest = hashlib.sha256(b"tandem-cache-scope")
    for part in (token, salt.encode() if salt else None):
        digest.update(b"\0" if part is None else b"\1" + len(part).to_bytes(8, "little") + part)
    return digest.digest()


def check_salt(salt: str | None) -> str | None:
    """A request's `cache_salt` as given, or INVALID_ARGUMENT when it is not one."""
    if salt is not None and not (0 < len(salt) <= MAX_SALT_CHARS and salt.isprintable()):
        raise invalid(f"cache_salt must be 1 to {MAX_SALT_CHARS} printable characters", "cache_salt")
    return salt
