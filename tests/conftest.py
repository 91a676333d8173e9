"""Shared fixtures: the real embedded model, tiny random models of each family, a real server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.service.models.default_model import default_gguf_path
from tandem.service.models.loader import convert_gguf, default_cache_dir

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
def tiny_server_http_port() -> int:
    from serverproc import free_port

    return free_port()


@pytest.fixture(scope="session")
def tiny_server(
    tiny_model_dir, tiny_server_http_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One real `tandem serve` of the tiny llama (serverproc.TINY_SERVER_*, defaults otherwise, and the
    OpenAI HTTP API on tiny_server_http_port), shared by the modules whose tests only need a server
    that serves: a start costs 10-15 s on two cores. Yields its gRPC address."""
    from serverproc import TINY_SERVER_KV_BLOCKS, TINY_SERVER_MODEL, running_server

    log = tmp_path_factory.mktemp("tiny-server") / "server.log"
    flags = ("--model-name", TINY_SERVER_MODEL, "--num-kv-blocks", str(TINY_SERVER_KV_BLOCKS))
    flags += ("--http-port", str(tiny_server_http_port))
    with running_server(tiny_model_dir("llama"), *flags, log=log) as (address, _proc):
        yield address


@pytest.fixture(scope="session")
def tiny_server_http(tiny_server: str, tiny_server_http_port: int) -> str:
    """The shared server's OpenAI HTTP API: its base URL (http://127.0.0.1:PORT)."""
    return f"http://127.0.0.1:{tiny_server_http_port}"
