"""tandem_model_info's labels say what the pod's engine reported it built, not what was asked: an
FP8 checkpoint served without `quantization` set still shows fp8 (the real server's /metrics is
checked in test_telemetry_server.py)."""

from __future__ import annotations

import pytest

from tandem.service import contract as c
from tandem.service.settings import ServerSettings
from tandem.service.telemetry.pod import PodTelemetry


def _ready(name: str, quantization: str, kv_cache_dtype: str) -> c.EngineReady:
    info = c.ModelInfo(name, "/models/m", "LlamaForCausalLM", "bfloat16", "cuda:0", [2], "/models/m",
                       quantization, kv_cache_dtype)
    return c.EngineReady(info, c.Limits(512, 4096, 256, 8, 256))


@pytest.mark.parametrize(
    ("settings", "quantization", "kv_cache_dtype"),
    [
        ({}, "none", "bfloat16"),
        ({}, "fp8", "bfloat16"),  # an FP8 checkpoint, the setting left unset
        ({"quantization": "fp8", "kv_cache_dtype": "fp8"}, "fp8", "fp8"),
    ],
)
def test_model_info_labels_follow_what_the_engine_built(settings: dict, quantization: str,
                                                        kv_cache_dtype: str):
    telemetry = PodTelemetry(ServerSettings(metrics_port=0, telemetry=False, **settings))
    try:
        assert telemetry.metrics.model_info() is None  # nothing loaded yet: no series
        telemetry.record(_ready("llama", quantization, kv_cache_dtype))
        assert telemetry.metrics.model_info() == {
            "model": "llama",
            "quantization": quantization,
            "kv_cache_dtype": kv_cache_dtype,
        }
    finally:
        telemetry.shutdown()
