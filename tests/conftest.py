"""Shared fixtures: the real embedded model, tiny random models of each family, real servers."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from serverproc import TINY_SERVER_FLAGS, ServerFactory

from tandem.service.models.default_model import default_gguf_path
from tandem.service.models.loader import convert_gguf, default_cache_dir

if TYPE_CHECKING:  # imported where used: the GPU image, which runs the gpu tests, has no openai
    import openai

# `make test` runs a worker per core: torch's work in a worker and in the processes it starts (CLI
# benchmarks) keeps to one thread, since threads that wait on a descheduled sibling (the other
# worker's) make every step several times slower. Servers size their own threads (cpu_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """SmolLM2-135M-Instruct de-quantized once into the user cache (reused across runs).

    TANDEM_TEST_MODEL_DIR names a transformers directory to use instead, for hosts without the
    embedded model's package (the GPU tests need only its tokenizer, for the tiny models).
    """
    if os.environ.get("TANDEM_TEST_MODEL_DIR"):
        return Path(os.environ["TANDEM_TEST_MODEL_DIR"])
    cache = Path(os.environ.get("TANDEM_TEST_CACHE", default_cache_dir()))
    return convert_gguf(default_gguf_path(), cache)


def make_tiny_config(family: str, vocab_size: int) -> object:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(vocab_size=vocab_size, **TINY)
    if family == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, use_sliding_window=False, **TINY)
    if family == "qwen3":
        return Qwen3Config(vocab_size=vocab_size, head_dim=16, use_sliding_window=False, **TINY)
    if family == "mistral":
        return MistralConfig(vocab_size=vocab_size, sliding_window=None, **TINY)
    raise ValueError(family)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path):
    """factory(family) -> directory with a tiny random model of that family + SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made: dict[str, Path] = {}
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)

    def make(family: str = "llama") -> Path:
        if family not in made:
            torch.manual_seed(0)
            config = make_tiny_config(family, len(tokenizer))
            config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
            config.bos_token_id = tokenizer.bos_token_id
            model = AutoModelForCausalLM.from_config(config)
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[family] = path
        return made[family]

    return make


@pytest.fixture(scope="session")
def shared_servers(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """The servers modules share (`serve(..., shared=True)`, tiny_server): one per set of settings,
    started when first asked for and stopped at the end of the session."""
    folder = functools.partial(tmp_path_factory.mktemp, "shared-server")
    with ServerFactory(tiny_model_dir, folder) as factory:
        yield factory


@pytest.fixture(scope="module")
def serve(
    tiny_model_dir,
    shared_servers: ServerFactory,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[ServerFactory]:
    """The factory of real `tandem serve` processes on loopback (serverproc.ServerFactory): a module
    declares the server it needs, e.g. `serve("--num-kv-blocks", "32", http=True, metrics=True)`,
    and gets a serverproc.LiveServer that runs until the module ends; `serve.started(...)` gives one
    for a `with` block, `serve(..., shared=True)` the session's server of those settings."""
    name = request.module.__name__.removeprefix("test_")
    folder = functools.partial(tmp_path_factory.mktemp, f"{name}-server")
    with ServerFactory(tiny_model_dir, folder, shared_servers) as factory:
        yield factory


@pytest.fixture(scope="session")
def tiny_server(shared_servers: ServerFactory) -> str:
    """The session's shared server of the tiny llama (serverproc.TINY_SERVER_*, defaults otherwise,
    and the OpenAI HTTP API on), for the modules whose tests only need a server that serves: a start
    costs 10-15 s on two cores. Its gRPC address."""
    return shared_servers(*TINY_SERVER_FLAGS, http=True, shared=True).address


@pytest.fixture(scope="session")
def tiny_server_http(shared_servers: ServerFactory) -> str:
    """The shared tiny server's OpenAI HTTP API: its base URL (http://127.0.0.1:PORT)."""
    return shared_servers(*TINY_SERVER_FLAGS, http=True, shared=True).http_url


@pytest.fixture(scope="session")
def tiny_openai(tiny_server_http: str) -> Iterator[openai.OpenAI]:
    """The published `openai` client on the shared tiny server (no retries: a failure shows)."""
    import openai

    with openai.OpenAI(base_url=f"{tiny_server_http}/v1", api_key="unused", max_retries=0, timeout=60.0) as c:
        yield c
