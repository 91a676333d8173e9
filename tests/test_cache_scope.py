"""Prefix-cache scopes on a real `tandem serve`: two tenants (bearer tokens) never share a cached
prefix, a request's `cache_salt` narrows its scope further, and every API reports the prompt
tokens a request found cached; asked by real clients (grpc stubs, the openai client, tritonclient).

One server serves the module, with a token file of two tokens and the default isolation (token).
Each test uses prompts of its own, so that what one test cached never meets another's.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as tc
from hypothesis import given, settings
from hypothesis import strategies as st
from serverproc import ServerFactory

from tandem.service.server.cache_scope import SHARED, cache_scope
from tandem.service.server.context import ModelContext
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MODEL_NAME = "tiny-scoped"
TENANT_A, TENANT_B = "tok-tenant-a-5d1c", "tok-tenant-b-9e2f"
TIMEOUT = 60.0
BLOCK = 16  # the server's KV block size (the default)


@pytest.fixture(scope="module")
def server(serve: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    tokens = tmp_path_factory.mktemp("scoped") / "tokens"
    tokens.write_text(f"{TENANT_A}\n{TENANT_B}\n")
    live = serve("--model-name", MODEL_NAME, "--auth-token-file", str(tokens), http=True)
    return live.address, live.http_port


def _prompt(topic: str) -> str:
    """A prompt of several full cache blocks, its own per test."""
    return f"About {topic}: you are a careful assistant. Answer briefly and cite the manual. " * 6


def _native(address: str, token: str, text: str, salt: str | None = None, stream: bool = False) -> pb.Usage:
    req = pb.GenerateRequest(text=text, stopping=pb.StoppingCriteria(max_tokens=2, ignore_eos=True))
    if salt is not None:
        req.cache_salt = salt
    metadata = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TandemStub(channel)
        if stream:
            return list(stub.GenerateStream(req, timeout=TIMEOUT, metadata=metadata))[-1].usage
        return stub.Generate(req, timeout=TIMEOUT, metadata=metadata).usage


def _whole(usage: pb.Usage) -> int:
    """What a repeat of a prompt finds cached: every full block but the one of its last token."""
    return (usage.prompt_tokens - 1) // BLOCK * BLOCK


def test_a_tenant_finds_only_its_own_cached_prefix(server):
    address, _ = server
    text = _prompt("tenants")
    first = _native(address, TENANT_A, text)
    assert first.cached_prompt_tokens == 0
    again = _native(address, TENANT_A, text, stream=True)
    assert again.cached_prompt_tokens == _whole(first) > 0
    assert _native(address, TENANT_B, text).cached_prompt_tokens == 0  # A's blocks are not B's
    assert _native(address, TENANT_B, text).cached_prompt_tokens == _whole(first)


def test_a_cache_salt_narrows_a_tenants_scope(server):
    address, _ = server
    text = _prompt("salts")
    whole = _whole(_native(address, TENANT_A, text))
    assert _native(address, TENANT_A, text, salt="team-1").cached_prompt_tokens == 0
    assert _native(address, TENANT_A, text, salt="team-1").cached_prompt_tokens == whole
    assert _native(address, TENANT_A, text, salt="team-2").cached_prompt_tokens == 0
    assert _native(address, TENANT_B, text, salt="team-1").cached_prompt_tokens == 0  # another tenant
    assert _native(address, TENANT_A, text).cached_prompt_tokens == whole  # the unsalted scope kept its own


def test_openai_clients_see_cached_tokens_and_send_a_salt(server):
    """OpenAI's usage.prompt_tokens_details.cached_tokens, and `cache_salt` in the body (vLLM's
    extension), on both endpoints."""
    _, http_port = server
    text = _prompt("openai")
    url = f"http://127.0.0.1:{http_port}/v1"
    with openai.OpenAI(base_url=url, api_key=TENANT_A, max_retries=0) as a, \
            openai.OpenAI(base_url=url, api_key=TENANT_B, max_retries=0) as b:  # fmt: skip

        def cached(client: openai.OpenAI, **extra: object) -> tuple[int, int]:
            usage = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=2, **extra).usage
            return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

        found, prompt_tokens = cached(a)
        whole = (prompt_tokens - 1) // BLOCK * BLOCK
        assert found == 0 and cached(a) == (whole, prompt_tokens)
        assert cached(b)[0] == 0
        salted = {"extra_body": {"cache_salt": "http-team"}}
        assert cached(a, **salted)[0] == 0 and cached(a, **salted)[0] == whole
        chat = [{"role": "user", "content": text}]
        first = a.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=2, **salted).usage
        again = a.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=2, **salted).usage
        assert first.prompt_tokens_details.cached_tokens == 0
        assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // BLOCK * BLOCK > 0
        streamed = list(a.completions.create(model=MODEL_NAME, prompt=text, max_tokens=2, stream=True,
                                             stream_options={"include_usage": True}))
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens == whole


def test_a_kserve_salt_names_the_same_scope(server):
    """KServe's request parameter `cache_salt`: a prompt cached through it is found by the native
    API under the same token and salt (and not without the salt)."""
    address, _ = server
    text = _prompt("kserve")
    headers = {"authorization": f"Bearer {TENANT_A}"}
    inputs = [tc.InferInput("text_input", [1], "BYTES"), tc.InferInput("max_tokens", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([2], dtype=np.int32))
    client = tc.InferenceServerClient(url=address)
    try:
        client.infer(MODEL_NAME, inputs, headers=headers, parameters={"cache_salt": "kserve-team"},
                     client_timeout=TIMEOUT)
        with pytest.raises(tc.InferenceServerException) as err:
            client.infer(MODEL_NAME, inputs, headers=headers, parameters={"cache_salt": 7},
                         client_timeout=TIMEOUT)
        assert "INVALID_ARGUMENT" in str(err.value.status()) and "cache_salt" in err.value.message()
    finally:
        client.close()
    salted = _native(address, TENANT_A, text, salt="kserve-team")
    assert salted.cached_prompt_tokens == _whole(salted) > 0
    assert _native(address, TENANT_A, text).cached_prompt_tokens == 0


def test_the_cli_sends_a_salt_and_shows_what_was_cached(server, tmp_path):
    """`tandem generate --cache-salt`: the second run of a prompt under one token and salt prints
    the cached prompt tokens beside the prompt's."""
    address, _ = server
    token_file = tmp_path / "token"
    token_file.write_text(TENANT_B)
    text = _prompt("the command line")
    cmd = [sys.executable, "-m", "tandem.cli", "generate", "--server", address, "--raw", text,
           "--max-tokens", "2", "--token-file", str(token_file), "--cache-salt", "cli-team"]
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    runs = [subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd="/")
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    usage = [re.search(r"(\d+) prompt \((\d+) cached\)", r.stderr) for r in runs]
    assert usage[0] and usage[1], runs[0].stderr
    prompt_tokens = int(usage[0][1])
    assert int(usage[0][2]) == 0 and int(usage[1][2]) == (prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert _native(address, TENANT_B, text).cached_prompt_tokens == 0  # the salt kept it apart


@pytest.mark.parametrize("salt", ["", "x" * 257, "tab\there"], ids=["empty", "too-long", "unprintable"])
def test_a_bad_salt_is_refused_with_a_clear_status(server, salt):
    address, http_port = server
    with pytest.raises(grpc.RpcError) as err:
        _native(address, TENANT_A, "Hello there", salt=salt)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()
    for bad in (salt, 123):
        conn = http.client.HTTPConnection(f"127.0.0.1:{http_port}", timeout=TIMEOUT)
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1, "cache_salt": bad}
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {TENANT_A}"})
        answer = conn.getresponse()
        error = json.loads(answer.read())["error"]
        conn.close()
        assert answer.status == 400 and "cache_salt" in error["message"], (bad, error)


_TOKENS = st.none() | st.binary(max_size=12)
_SALTS = st.none() | st.text(max_size=12)


@settings(max_examples=300, deadline=None)
@given(_TOKENS, _SALTS, _TOKENS, _SALTS)
def test_two_callers_share_a_scope_only_when_token_and_salt_are_the_same(t1, s1, t2, s2):
    """Whatever the bytes of a token and the characters of a salt (a token that ends as another's
    salt begins, say), two requests are of one scope exactly when they present the same token and
    the same salt (no salt and an empty one being the same)."""
    same = (t1, s1 or None) == (t2, s2 or None)
    assert (cache_scope(t1, s1) == cache_scope(t2, s2)) == same


def test_scopes_name_token_and_salt_unambiguously():
    """No token and no salt: the shared scope; any other pair: a digest of its own, so that no two
    different (token, salt) pairs share a scope, and a server that shares across tenants
    (`prefix_cache_isolation=shared`) keeps only the salt."""
    assert cache_scope(None, None) == cache_scope(None, "") == SHARED
    scopes = [cache_scope(t, s) for t, s in [(b"ab", "c"), (b"a", "bc"), (b"a", None), (None, "a"),
                                             (b"b", None), (b"a", "c")]]
    assert len(set(scopes)) == len(scopes) and SHARED not in scopes
    shared = ModelContext(None, None, None, None, isolate_tokens=False)
    isolated = ModelContext(None, None, None, None, isolate_tokens=True)
    assert shared.cache_scope(b"tok", None) == SHARED
    assert shared.cache_scope(b"tok", "s") == shared.cache_scope(b"other", "s") == cache_scope(None, "s")
    assert isolated.cache_scope(b"tok", None) == cache_scope(b"tok", None) != SHARED
