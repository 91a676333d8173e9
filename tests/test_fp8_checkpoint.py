"""FP8 checkpoints as published, written here from a real (tiny, random) Llama: compressed-tensors
"FP8-dynamic" checkpoints made by the compressed-tensors library itself, and block-wise FP8 in the
layout Qwen3-FP8 / DeepSeek publish. They load into FP8 layers holding the checkpoint's own weights
and scales, compute what the dequantized checkpoint computes, run in the engine and over the wire;
schemes the engine does not run are refused, naming what loads."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams
from engine_harness import Arrival, hf_greedy, make_core, run
from safetensors import safe_open
from safetensors.torch import save_file
from serverproc import running_server
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from tandem.service.contract import SamplingParams
from tandem.service.engine.ops.fp8_linear import FP8, FP8_MAX, Fp8Linear, quantize_rows
from tandem.service.engine.ops.fp8_mlp import Fp8GatedMLP
from tandem.service.engine.ops.fused_projections import fuse_projections
from tandem.service.models.fp8_checkpoint import UnsupportedQuantization
from tandem.service.models.loader import load_model
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

CPU = torch.device("cpu")
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def _source(tiny_model_dir) -> nn.Module:
    """The tiny llama in bf16, the dtype FP8 checkpoints are published from."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.bfloat16).eval()


def _with_tokenizer(path: Path, tokenizer_dir: Path) -> Path:
    """`path` with the tokenizer of the model in `tokenizer_dir` beside its weights."""
    for file in tokenizer_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, path)
    return path


def write_compressed_tensors(
    model: nn.Module, path: Path, scheme: QuantizationScheme, ignore: list[str]
) -> Path:
    """What llm-compressor does for FP8-dynamic, with the compressed-tensors library: apply the
    scheme, set each weight's scale from its range (a min-max observer), compress, save."""
    model = copy.deepcopy(model)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight, args = module.weight.detach(), module.quantization_scheme.weights
        if args.strategy == "channel":
            low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
        else:
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        scale, _ = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return _with_tokenizer(path, Path(model.name_or_path))


def fp8_dynamic(strategy: str = "channel") -> QuantizationScheme:
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    scheme.weights.strategy = strategy
    return scheme


def write_block_fp8(model: nn.Module, path: Path, block: list[int] | None) -> Path:
    """Block-wise FP8 as Qwen3-FP8 publishes it: every linear layer but lm_head in e4m3, with
    `weight_scale_inv` (the dequantization multiplier) per block of `block`, or one per tensor."""
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is model.lm_head:
            continue
        weight = module.weight.detach().float()
        if block is None:
            scale = weight.abs().amax().reshape(1) / FP8_MAX
            full = scale.expand_as(weight)
        else:
            (rows, columns), (br, bc) = weight.shape, block
            padded = torch.zeros(-(-rows // br) * br, -(-columns // bc) * bc)
            padded[:rows, :columns] = weight.abs()
            blocks = padded.reshape(padded.shape[0] // br, br, -1, bc).amax(dim=(1, 3))
            scale = blocks / FP8_MAX
            full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :columns]
        tensors[f"{name}.weight"] = (weight / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[f"{name}.weight_scale_inv"] = scale.float().contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return _with_tokenizer(path, Path(model.name_or_path))


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def _dequantized(tensors: dict[str, torch.Tensor], name: str, block: list[int] | None = None) -> torch.Tensor:
    """Layer `name`'s weights as the checkpoint means them, in float64."""
    weight = tensors[f"{name}.weight"].double()
    scale = tensors.get(f"{name}.weight_scale", tensors.get(f"{name}.weight_scale_inv")).double()
    if block is not None:
        rows, columns = weight.shape
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return weight * (scale if scale.dim() == 2 else scale.reshape(-1, 1))


class _Reference(nn.Module):
    """A linear layer of the dequantized checkpoint's weights with activations quantized per
    token, in float64: what the FP8 layers compute, without the scaled GEMM."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight64 = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x)
        return ((xq.double() * xs.double()) @ self.weight64.t()).to(x.dtype)


def _reference_model(path: Path, block: list[int] | None = None) -> nn.Module:
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config  # the plain model; its FP8 layers are replaced below
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    tensors = _checkpoint(path)
    for name in [name for name, _ in model.named_modules()]:
        if f"{name}.weight" in tensors and tensors[f"{name}.weight"].dtype == FP8:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _Reference(_dequantized(tensors, name, block)))
    return model


@pytest.fixture(scope="module")
def channel_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ct-fp8-dynamic")
    return write_compressed_tensors(_source(tiny_model_dir), path, fp8_dynamic(), ["lm_head"])


def _plain_model_fp32(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).float()


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_checkpoint_loads_its_own_weights_and_scales(strategy, tiny_model_dir, tmp_path):
    source = _source(tiny_model_dir)
    path = write_compressed_tensors(source, tmp_path, fp8_dynamic(strategy), ["lm_head"])
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
    tensors = _checkpoint(path)
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == FP8
    loaded = load_model(str(path), None, CPU, cache_dir=tmp_path / "cache")
    assert loaded.quantization == "fp8"
    model = loaded.model
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == LINEARS_PER_LAYER * model.config.num_hidden_layers
    for name, layer in layers:
        assert torch.equal(layer.weight.view(torch.uint8), tensors[f"{name}.weight"].view(torch.uint8)), name
        scale = tensors[f"{name}.weight_scale"].float().flatten().expand(layer.out_features)
        assert torch.equal(layer.weight_scale.flatten(), scale), name
    # ignored: lm_head stays a plain layer in the model's dtype, with the checkpoint's weights
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].float())


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_logits_are_the_dequantized_checkpoints(strategy, tiny_model_dir, tmp_path):
    source = _source(tiny_model_dir)
    path = write_compressed_tensors(source, tmp_path, fp8_dynamic(strategy), ["lm_head"])
    model = load_model(str(path), None, CPU, cache_dir=tmp_path / "cache").model
    reference = _reference_model(path)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        torch.testing.assert_close(logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        original = _plain_model_fp32(source)(input_ids=ids).logits
    assert (logits - original).norm() / original.norm() < 0.1  # FP8's error, not another model


def test_ignored_layers_stay_in_the_models_dtype(tiny_model_dir, tmp_path):
    path = write_compressed_tensors(
        _source(tiny_model_dir), tmp_path, fp8_dynamic(), ["lm_head", "re:.*down_proj$"]
    )
    model = load_model(str(path), None, CPU, cache_dir=tmp_path / "cache").model
    for layer in model.model.layers:
        assert type(layer.mlp.down_proj) is nn.Linear and layer.mlp.down_proj.weight.dtype == torch.float32
        assert isinstance(layer.mlp.up_proj, Fp8Linear)


def test_fp8_weights_the_config_does_not_name_are_refused(tiny_model_dir, tmp_path):
    """A config whose `ignore` leaves out layers the checkpoint holds in FP8 would run raw e4m3
    values as weights: refused."""
    path = write_compressed_tensors(_source(tiny_model_dir), tmp_path, fp8_dynamic(), ["lm_head"])
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*o_proj$"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match=r"does not name \(model.layers.0.self_attn.o_proj"):
        load_model(str(path), None, CPU, cache_dir=tmp_path / "cache")


def _w8a16_fp8() -> QuantizationScheme:
    scheme = fp8_dynamic()
    scheme.input_activations = None
    return scheme


# what llm-compressor writes for each: the scheme, the checkpoint's format, and why it is refused
UNSUPPORTED = {
    "int4 weights": ("W4A16", "pack-quantized", "format 'pack-quantized'"),
    "int8 W8A8": ("W8A8", "int-quantized", "format 'int-quantized'"),
    "FP8 weights only": (None, "float-quantized", r"weight-only FP8 \(W8A16\)"),
    "static activations": ("FP8", "float-quantized", "tensor strategy, symmetric, static"),
    "FP8 blocks": ("FP8_BLOCK", "float-quantized", "strategy block"),
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
def test_compressed_tensors_schemes_not_run_are_refused_naming_what_loads(kind, tiny_model_dir, tmp_path):
    preset, fmt, reason = UNSUPPORTED[kind]
    scheme = preset_name_to_scheme(preset, ["Linear"]) if preset else _w8a16_fp8()
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt)
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    ModelCompressor(quantization_config=config).update_config(str(tmp_path))
    with pytest.raises(UnsupportedQuantization, match=reason) as refused:
        load_model(str(tmp_path), None, CPU, cache_dir=tmp_path / "cache")
    assert "Tandem loads compressed-tensors float-quantized FP8" in str(refused.value)
    assert "block-wise FP8" in str(refused.value)


@pytest.mark.parametrize(
    ("quantization_config", "reason"),
    [
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "token",
                            "dynamic": True,
                        },
                    }
                },
                "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"},
            },
            "sparsity 'sparse-24-bitmask'",
        ),
        (
            {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static", "weight_block_size": None},
            "activation_scheme 'static'",
        ),
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ],
    ids=["2:4 sparsity", "static FP8 activations", "awq"],
)
def test_other_quantizations_are_refused_naming_what_loads(
    quantization_config, reason, tiny_model_dir, tmp_path
):
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(UnsupportedQuantization, match=reason) as refused:
        load_model(str(tmp_path), None, CPU, cache_dir=tmp_path / "cache")
    assert "Tandem loads" in str(refused.value)


@pytest.mark.parametrize("block", [[128, 128], [32, 48], None], ids=["128x128", "32x48", "per-tensor"])
def test_block_fp8_loads_requantized_per_channel(block, tiny_model_dir, tmp_path):
    source = _source(tiny_model_dir)
    path = write_block_fp8(source, tmp_path, block)
    tensors = _checkpoint(path)
    loaded = load_model(str(path), None, CPU, cache_dir=tmp_path / "cache")
    model = loaded.model
    assert loaded.quantization == "fp8"
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == LINEARS_PER_LAYER * model.config.num_hidden_layers
    for name, layer in layers:
        exact = _dequantized(tensors, name, block)
        if block is None:  # one scale per tensor is a scale per channel: the weights as they are
            assert torch.equal(layer.weight.view(torch.uint8), tensors[f"{name}.weight"].view(torch.uint8))
        # one more e4m3 rounding at the row's scale: half an e4m3 step at most
        row_scale = layer.weight_scale.double().t()
        bound = torch.maximum(exact.abs() / 16, row_scale * 2**-10) + 1e-12
        assert ((layer.dequantized(torch.float64) - exact).abs() <= bound).all(), name
    ids = torch.randint(0, model.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        reference = _reference_model(path, block)(input_ids=ids).logits
        original = _plain_model_fp32(source)(input_ids=ids).logits
    if block is None:
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert (logits - reference).norm() / reference.norm() < 0.05  # the requantization's share
    assert (logits - original).norm() / original.norm() < 0.1


@pytest.mark.parametrize("fmt", ["compressed-tensors", "block"])
def test_engine_on_an_fp8_checkpoint_gives_generate_tokens(fmt, channel_checkpoint, tiny_model_dir, tmp_path):
    path = (
        channel_checkpoint
        if fmt == "compressed-tensors"
        else write_block_fp8(_source(tiny_model_dir), tmp_path, [32, 32])
    )
    model = load_model(str(path), None, CPU, cache_dir=tmp_path / "cache").model
    reference = copy.deepcopy(model)
    fuse_projections(reference)  # what the engine does to its model
    core = make_core(model, fuse_projections=True, quantization="fp8", max_num_batched_tokens=32)
    mlp = model.model.layers[0].mlp  # the engine's FP8 gated MLP over the checkpoint's layers, fused
    assert isinstance(mlp, Fp8GatedMLP) and isinstance(mlp.gate_up, Fp8Linear)
    prompts = [[(11 * i + j) % 1000 for j in range(n)] for i, n in enumerate([5, 40, 1, 17])]
    arrivals = [Arrival(f"r{i}", p, SamplingParams(max_tokens=10), i) for i, p in enumerate(prompts)]
    result = run(core, arrivals)
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(reference, a.prompt_ids, 10, None), a.request_id


def test_fp8_checkpoint_served_over_the_wire(channel_checkpoint, tmp_path):
    """`tandem serve --model DIR` on a compressed-tensors checkpoint; --quantization fp8 beside it
    changes nothing."""
    model = load_model(str(channel_checkpoint), None, CPU, cache_dir=tmp_path / "cache").model
    prompt = list(range(100, 120))
    log = tmp_path / "server.log"
    with running_server(channel_checkpoint, "--quantization", "fp8", "--num-kv-blocks", "64", log=log) as (
        address,
        _,
    ):
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.TandemStub(channel)
            req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=10, ignore_eos=True))
            req.token_ids.ids.extend(prompt)
            tokens = [t for m in stub.GenerateStream(req, timeout=60) for t in m.token_ids]
    assert tokens == hf_greedy(model, prompt, 10, None)
    text = log.read_text()
    assert "loaded 14 linear layers in FP8 from a compressed-tensors FP8 (channel weights" in text
    assert "quantization fp8 changes nothing" in text and "quantized 14 linear layers" not in text
    assert "LOAD REPORT" not in text  # the scales transformers leaves unread are not reported as a fault
