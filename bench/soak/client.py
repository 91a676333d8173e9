"""The client of `tandem bench soak`: each stream makes its calls one after another on the kind each
names, cancelling those the plan says to, and records what came back (the process skeleton is
serve/client.py's).

What is recorded per request (`Outcome`) is what the checks need: the status, what the server said it
generated (native usage.completion_tokens) beside what arrived (token ids; KServe: text only), the
KServe stream's final-response flags, and the text of probes.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from tandem.bench.serve.client import Send
from tandem.bench.soak.outcome import Outcome
from tandem.kserve import grpc_service_pb2 as kpb
from tandem.kserve import grpc_service_pb2_grpc as kpb_grpc
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

LONG_TIMEOUT_S = 600.0  # requests the soak does not cancel: past this one counts as a hang


def _native_request(r: dict) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=r["temperature"])
    if r["seed"] is not None:
        sampling.seed = r["seed"]
    return pb.GenerateRequest(
        text=r["prompt"],
        sampling=sampling,
        stopping=pb.StoppingCriteria(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]),
    )


def _kserve_request(r: dict, stream: bool) -> kpb.ModelInferRequest:
    """Triton's LLM tensors, raw; the served model's name (`model`) is the parent's to fill in."""
    params = {"temperature": r["temperature"]}
    if r["seed"] is not None:
        params["seed"] = r["seed"]
    tensors = [
        ("text_input", "BYTES", _bytes_tensor(r["prompt"].encode())),
        ("max_tokens", "INT32", struct.pack("<i", r["max_tokens"])),
        ("sampling_parameters", "BYTES", _bytes_tensor(json.dumps(params).encode())),
        ("stream", "BOOL", bytes([stream])),
        ("exclude_input_in_output", "BOOL", bytes([r["exclude_input"]])),
    ]
    req = kpb.ModelInferRequest(
        model_name=r["model"],
        id=str(r["index"]),
        inputs=[kpb.ModelInferRequest.InferInputTensor(name=n, datatype=d, shape=[1]) for n, d, _ in tensors],
        raw_input_contents=[raw for _, _, raw in tensors],
    )
    if r["cancel"] == "timeout_param":
        req.parameters["timeout"].int64_param = max(1, round(r["deadline_s"] * 1e6))
    return req


def _bytes_tensor(item: bytes) -> bytes:
    return struct.pack("<I", len(item)) + item


def _text_output(resp: kpb.ModelInferResponse) -> str:
    raw = resp.raw_output_contents[0]
    (n,) = struct.unpack_from("<I", raw, 0)
    return raw[4 : 4 + n].decode()


def _timeout(r: dict) -> float:
    return r["deadline_s"] if r["cancel"] == "deadline" else LONG_TIMEOUT_S


def _keep_text(o: Outcome, r: dict, text: str) -> None:
    """KServe: the prompt comes first unless excluded; probes keep the answer for the comparison."""
    if r["kind"].startswith("kserve") and not r["exclude_input"]:
        o.prefix_ok = text.startswith(r["prompt"])
        text = text[len(r["prompt"]) :] if o.prefix_ok else text
    if r["probe"] is not None:
        o.text = text


async def _native_unary(stub: pb_grpc.TandemStub, r: dict, o: Outcome) -> None:
    resp = await stub.Generate(_native_request(r), timeout=_timeout(r))
    o.messages, o.tokens = 1, len(resp.token_ids)
    o.completion_tokens = resp.usage.completion_tokens
    o.finish_reason = pb.FinishReason.Name(resp.finish_reason)
    _keep_text(o, r, resp.text)
    if r["probe"] is not None:
        o.token_ids = list(resp.token_ids)


async def _native_stream(stub: pb_grpc.TandemStub, r: dict, o: Outcome) -> None:
    call = stub.GenerateStream(_native_request(r), timeout=_timeout(r))
    if status := await _cancel(call, r, 0, ended=False):
        o.status, o.cancelled = status, True
        return
    text, ids = [], []
    async for msg in call:
        o.messages += 1
        ids += msg.token_ids
        text.append(msg.text)
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            o.finish_reason = pb.FinishReason.Name(msg.finish_reason)
            o.completion_tokens = msg.usage.completion_tokens
        if status := await _cancel(call, r, o.messages, ended=o.finish_reason is not None):
            o.status, o.cancelled = status, True
            return
    o.tokens = len(ids)
    _keep_text(o, r, "".join(text))
    if r["probe"] is not None:
        o.token_ids = ids


async def _kserve_unary(stub: kpb_grpc.GRPCInferenceServiceStub, r: dict, o: Outcome) -> None:
    resp = await stub.ModelInfer(_kserve_request(r, stream=False), timeout=_timeout(r))
    o.messages = 1
    _keep_text(o, r, _text_output(resp))


def _answered(o: Outcome) -> bool:
    return bool(o.error_message or (o.finals and o.finals[-1]))


async def _kserve_call(stub: kpb_grpc.GRPCInferenceServiceStub, unit: list[dict]) -> list[Outcome]:
    """One ModelStreamInfer call carrying `unit` (one request, or a few that share the stream): the
    responses are told apart by the request id they echo. The first request's cancel is the call's."""
    lead, start = unit[0], time.perf_counter()
    out = {r["index"]: Outcome(r["index"], r["kind"]) for r in unit}
    texts: dict[int, list[str]] = {i: [] for i in out}

    async def requests() -> AsyncIterator[kpb.ModelInferRequest]:
        for r in unit:
            yield _kserve_request(r, stream=True)
        # then the client half-closes: the server ends the stream once every request has answered

    call = stub.ModelStreamInfer(requests(), timeout=_timeout(lead))
    messages, details = 0, None
    status = await _cancel(call, lead, 0, ended=False)
    try:
        async for msg in _unless(status, call):
            messages += 1
            if msg.error_message:  # names no request: the first one still waiting for its answer
                o = next((o for o in out.values() if not _answered(o)), out[lead["index"]])
                o.error_message = msg.error_message
            elif (o := out.get(_index(msg.infer_response.id))) is None:
                o = out[lead["index"]]
                o.error_message = f"a response for request id {msg.infer_response.id!r}, not on this call"
            else:
                o.finals.append(msg.infer_response.parameters["triton_final_response"].bool_param)
                texts[o.index].append(_text_output(msg.infer_response))
            o.messages += 1
            ended = all(_answered(x) for x in out.values())
            if status := await _cancel(call, lead, messages, ended=ended):
                break
    except grpc.aio.AioRpcError as err:
        status, details = err.code().name, err.details() or err.code().name
    for r in unit:
        o = out[r["index"]]
        o.seconds = time.perf_counter() - start
        if status is not None and not _answered(o):  # what had its answer before the call ended keeps it
            o.status, o.cancelled, o.error_message = status, details is None, details
        elif o.status == "OK" and not o.error_message:
            _keep_text(o, r, "".join(texts[o.index]))
    return list(out.values())


def _index(request_id: str) -> int | None:
    return int(request_id) if request_id.isdigit() else None


async def _unless(status: str | None, call: grpc.aio.Call) -> AsyncIterator:
    """The call's messages; none if it already ended (`status`)."""
    if status is None:
        async for msg in call:
            yield msg


async def _cancel(call: grpc.aio.Call, r: dict, messages: int, ended: bool) -> str | None:
    """Cancel `call` here if the plan says so: after `cancel_after` messages (0: right after it
    starts, before any answer), never once its last answer is in. The status it ended with, or None."""
    if r["cancel"] != "chunks" or messages != r["cancel_after"] or ended or call.done():
        return None
    if messages == 0:
        await asyncio.sleep(0)
    call.cancel()
    return (await call.code()).name


RUN = {"native_unary": _native_unary, "native_stream": _native_stream, "kserve_unary": _kserve_unary}


async def _one(stubs: dict, unit: list[dict]) -> list[Outcome]:
    """The outcomes of one call: a KServe stream's requests, or one request of another kind."""
    r = unit[0]
    if r["kind"] == "kserve_stream":
        return await _kserve_call(stubs["kserve"], unit)
    o = Outcome(r["index"], r["kind"])
    start = time.perf_counter()
    try:
        await RUN[r["kind"]](stubs["kserve" if r["kind"].startswith("kserve") else "native"], r, o)
    except grpc.aio.AioRpcError as err:
        o.status, o.error_message = err.code().name, err.details()
    o.seconds = time.perf_counter() - start
    return [o]


@asynccontextmanager
async def connect(address: str, channels: int, done: object) -> AsyncIterator[Send]:
    """`channels` connections to the server; each call's requests counted in `done` as they end (the
    parent watches it for progress and hangs). A call is a list of requests: soak/workload.calls."""
    # separate connections, so that the server's fronts (SO_REUSEPORT) each get some
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 * 1024**2)]
    chans = [grpc.aio.insecure_channel(address, options=opts) for _ in range(channels)]
    for c in chans:
        await c.channel_ready()
    stubs = [{"native": pb_grpc.TandemStub(c), "kserve": kpb_grpc.GRPCInferenceServiceStub(c)} for c in chans]

    async def send(i: int, unit: list[dict]) -> list[Outcome]:
        outcomes = await _one(stubs[i % len(stubs)], unit)
        with done.get_lock():
            done.value += len(unit)
        return outcomes

    try:
        yield send
    finally:
        for c in chans:
            await c.close()
