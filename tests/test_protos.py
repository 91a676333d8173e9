"""The generated stubs are current, and the KServe v2 protos match tritonclient's on the wire.

Our ``inference.*`` messages and tritonclient's cannot share a process's default descriptor pool
(both define the same symbols, so the second import fails with "duplicate symbol"). Each side's
descriptors are therefore dumped from a child process as a FileDescriptorSet and compared here,
in private pools, without importing either set of stubs into the test process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

REPO_ROOT = Path(__file__).resolve().parent.parent

OURS = ["tandem.kserve.model_config_pb2", "tandem.kserve.grpc_service_pb2"]
TRITON = ["tritonclient.grpc.model_config_pb2", "tritonclient.grpc.service_pb2"]
SERVICE = "inference.GRPCInferenceService"
RPCS = {
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelStreamInfer",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
}

# Imports the given _pb2 modules and writes their files as a serialized FileDescriptorSet.
# The working directory is dropped from sys.path and the repo root appended instead: the root's
# `operator/` package would otherwise shadow the standard library module of that name.
_DUMP = """
import importlib, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")] + [sys.argv[1]]
from google.protobuf import descriptor_pb2
fds = descriptor_pb2.FileDescriptorSet()
for name in sys.argv[2:]:
    importlib.import_module(name).DESCRIPTOR.CopyToProto(fds.file.add())
sys.stdout.buffer.write(fds.SerializeToString())
"""


def _dump(modules: list[str]) -> descriptor_pb2.FileDescriptorSet:
    proc = subprocess.run(
        [sys.executable, "-c", _DUMP, str(REPO_ROOT), *modules], cwd=REPO_ROOT, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return descriptor_pb2.FileDescriptorSet.FromString(proc.stdout)


@pytest.fixture(scope="module")
def ours() -> descriptor_pb2.FileDescriptorSet:
    return _dump(OURS)


@pytest.fixture(scope="module")
def triton() -> descriptor_pb2.FileDescriptorSet:
    return _dump(TRITON)


def _messages(fds: descriptor_pb2.FileDescriptorSet) -> dict[str, descriptor_pb2.DescriptorProto]:
    """Every message (nested and map entries included) by full name."""
    out: dict[str, descriptor_pb2.DescriptorProto] = {}

    def walk(prefix: str, msgs) -> None:
        for m in msgs:
            name = f"{prefix}.{m.name}"
            out[name] = m
            walk(name, m.nested_type)

    for f in fds.file:
        walk(f.package, f.message_type)
    return out


def _enums(fds: descriptor_pb2.FileDescriptorSet) -> dict[str, descriptor_pb2.EnumDescriptorProto]:
    out: dict[str, descriptor_pb2.EnumDescriptorProto] = {}

    def walk(prefix: str, msgs) -> None:
        for m in msgs:
            for e in m.enum_type:
                out[f"{prefix}.{m.name}.{e.name}"] = e
            walk(f"{prefix}.{m.name}", m.nested_type)

    for f in fds.file:
        for e in f.enum_type:
            out[f"{f.package}.{e.name}"] = e
        walk(f.package, f.message_type)
    return out


def _field_sig(msg: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto) -> dict:
    oneof = msg.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None
    return {
        "number": field.number,
        "type": descriptor_pb2.FieldDescriptorProto.Type.Name(field.type),
        "label": descriptor_pb2.FieldDescriptorProto.Label.Name(field.label),
        "type_name": field.type_name,
        "oneof": oneof,
        "proto3_optional": field.proto3_optional,
    }


def test_stubs_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fields_match_triton(ours, triton) -> None:
    our_msgs, their_msgs = _messages(ours), _messages(triton)
    # The messages the brief names must all be there, and we define nothing Triton lacks.
    for name in [
        "inference.InferParameter",
        "inference.InferTensorContents",
        "inference.ModelInferRequest.InferInputTensor",
        "inference.ModelInferRequest.InferRequestedOutputTensor",
        "inference.ModelInferResponse.InferOutputTensor",
        "inference.ModelStreamInferResponse",
        "inference.ModelConfig",
        "inference.ModelInput",
        "inference.ModelOutput",
        "inference.ModelTransactionPolicy",
        "inference.ModelParameter",
        "inference.ModelStatistics",
        "inference.InferStatistics",
        "inference.StatisticDuration",
        "inference.RepositoryIndexResponse.ModelIndex",
    ]:
        assert name in our_msgs, name
    assert set(our_msgs) <= set(their_msgs), sorted(set(our_msgs) - set(their_msgs))

    mismatches = []
    for name, msg in our_msgs.items():
        theirs = {f.name: f for f in their_msgs[name].field}
        assert msg.options.map_entry == their_msgs[name].options.map_entry, name
        for field in msg.field:
            if field.name not in theirs:
                mismatches.append(f"{name}.{field.name}: not in tritonclient")
                continue
            mine, their = _field_sig(msg, field), _field_sig(their_msgs[name], theirs[field.name])
            if mine != their:
                mismatches.append(f"{name}.{field.name}: ours {mine} != tritonclient {their}")
    assert not mismatches, "\n".join(mismatches)


def test_enums_match_triton(ours, triton) -> None:
    our_enums, their_enums = _enums(ours), _enums(triton)
    assert "inference.DataType" in our_enums
    for name, enum in our_enums.items():
        assert name in their_enums, name
        theirs = {v.name: v.number for v in their_enums[name].value}
        assert {v.name: v.number for v in enum.value}.items() <= theirs.items(), name


def test_service_matches_triton(ours, triton) -> None:
    def methods(fds: descriptor_pb2.FileDescriptorSet) -> dict[str, tuple[str, str, bool, bool]]:
        for f in fds.file:
            for s in f.service:
                if f"{f.package}.{s.name}" == SERVICE:
                    return {
                        m.name: (
                            m.input_type.lstrip("."),
                            m.output_type.lstrip("."),
                            m.client_streaming,
                            m.server_streaming,
                        )
                        for m in s.method
                    }
        raise AssertionError(f"{SERVICE} not found")

    mine, theirs = methods(ours), methods(triton)
    assert set(mine) == RPCS
    for rpc in sorted(RPCS):
        assert mine[rpc] == theirs[rpc], rpc
    assert mine["ModelStreamInfer"] == (
        "inference.ModelInferRequest",
        "inference.ModelStreamInferResponse",
        True,
        True,
    )


def test_wire_round_trip(ours, triton) -> None:
    """Bytes from our messages parse into tritonclient's with every value intact, and back."""

    def classes(fds: descriptor_pb2.FileDescriptorSet) -> dict[str, type]:
        pool = descriptor_pool.DescriptorPool()  # private: never the process's default pool
        for f in fds.file:
            pool.Add(f)
        return {
            n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"inference.{n}"))
            for n in ("ModelInferRequest", "ModelStreamInferResponse", "ModelConfigResponse")
        }

    mine, theirs = classes(ours), classes(triton)

    req = mine["ModelInferRequest"](model_name="tandem", model_version="1", id="r1")
    req.parameters["max_tokens"].int64_param = 16
    req.parameters["temperature"].double_param = 0.5
    inp = req.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    inp.parameters["binary_data_size"].int64_param = 9
    req.outputs.add(name="text_output")
    req.raw_input_contents.append(b"\x05\x00\x00\x00hello")
    parsed = theirs["ModelInferRequest"].FromString(req.SerializeToString())
    assert parsed.model_name == "tandem" and parsed.id == "r1"
    assert parsed.parameters["max_tokens"].int64_param == 16
    assert parsed.parameters["temperature"].double_param == 0.5
    assert parsed.inputs[0].name == "text_input" and list(parsed.inputs[0].shape) == [1, 1]
    assert parsed.inputs[0].parameters["binary_data_size"].int64_param == 9
    assert parsed.outputs[0].name == "text_output"
    assert list(parsed.raw_input_contents) == [b"\x05\x00\x00\x00hello"]
    assert mine["ModelInferRequest"].FromString(parsed.SerializeToString()) == req

    resp = mine["ModelStreamInferResponse"]()
    out = resp.infer_response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    out.contents.bytes_contents.append(b"hi")
    resp.infer_response.raw_output_contents.append(b"\x02\x00\x00\x00hi")
    parsed_resp = theirs["ModelStreamInferResponse"].FromString(resp.SerializeToString())
    assert parsed_resp.infer_response.outputs[0].contents.bytes_contents == [b"hi"]
    assert list(parsed_resp.infer_response.raw_output_contents) == [b"\x02\x00\x00\x00hi"]

    cfg = mine["ModelConfigResponse"]()
    c = cfg.config
    c.name, c.platform, c.backend, c.max_batch_size = "tandem", "tandem", "tandem", 0
    c.input.add(name="text_input", data_type=13, dims=[1], optional=False)
    c.input.add(name="max_tokens", data_type=9, dims=[1], optional=True)
    c.output.add(name="text_output", data_type=13, dims=[-1])
    c.model_transaction_policy.decoupled = True
    c.parameters["model_id"].string_value = "smollm2"
    tc = theirs["ModelConfigResponse"].FromString(cfg.SerializeToString()).config
    assert (tc.name, tc.backend, tc.max_batch_size) == ("tandem", "tandem", 0)
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in tc.input] == [
        ("text_input", 13, [1], False),
        ("max_tokens", 9, [1], True),
    ]
    assert [(o.name, o.data_type, list(o.dims)) for o in tc.output] == [("text_output", 13, [-1])]
    assert tc.model_transaction_policy.decoupled is True
    assert tc.parameters["model_id"].string_value == "smollm2"
