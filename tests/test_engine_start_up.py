"""The engine's build as the start-up counts it: its compile phase logged part by part, and the
parts summed into the phases `tandem_startup_seconds` reports (telemetry/startup.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_tiny_config
from engine_harness import make_core
from transformers import AutoModelForCausalLM

from tandem.service.engine.core_builder import COMPILE_PARTS, start_up_phases


def test_graph_capture_is_its_own_phase_and_every_other_part_is_the_compile():
    parts = {"decode_kernel_variants": 0.5, "fp8_gemm_variants": 2.0, "decode_forwards": 10.0,
             "graph_capture": 1.5, "prefill_shapes": 4.0}
    assert start_up_phases(parts) == pytest.approx({"compile": 16.5, "graph_capture": 1.5})
    assert start_up_phases({}) == {"compile": 0.0, "graph_capture": 0.0}


def test_the_build_logs_its_compile_phase_part_by_part(caplog):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_tiny_config("llama", 128)).eval()
    with caplog.at_level(logging.INFO, logger="tandem.service.engine.core_builder"):
        core = make_core(model, compile_backend="eager", compile_prefill=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled in ")]
    assert len(lines) == 1, lines
    assert all(f"{part} " in lines[0] for part in COMPILE_PARTS.values()), lines[0]
    assert set(core.start_up_seconds) == {"compile", "graph_capture"}
    # the prefill shapes were compiled (run) on the CPU, so the compile phase holds their time
    prefill = float(lines[0].split(COMPILE_PARTS["prefill_shapes"] + " ")[1].split(" s")[0])
    assert core.start_up_seconds["compile"] >= prefill - 0.005 and prefill > 0  # the log rounds to 0.01 s
