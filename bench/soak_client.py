"""One client process of `tandem bench soak`: its share of the streams, each sending its requests one
after another on the kind each names, cancelling those the plan says to, and recording what came back.

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
from dataclasses import asdict, dataclass, field

import _repo  # noqa: F401  (tandem.v1 from this checkout)
import grpc

from tandem.kserve import grpc_service_pb2 as kpb
from tandem.kserve import grpc_service_pb2_grpc as kpb_grpc
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

LONG_TIMEOUT_S = 600.0  # requests the soak does not cancel: past this one counts as a hang


@dataclass
class Outcome:
    index: int
    kind: str
    status: str = "OK"
    seconds: float = 0.0
    messages: int = 0
    tokens: int | None = None  # native: token ids received
    completion_tokens: int | None = None  # native: usage on the last message
    finish_reason: str | None = None  # native
    finals: list[bool] = field(default_factory=list)  # KServe stream: triton_final_response per response
    error_message: str | None = None  # KServe stream: a response with error_message
    cancelled: bool = False  # the soak cancelled the call itself
    prefix_ok: bool | None = None  # KServe without exclude_input: the output starts with the prompt
    text: str | None = None  # probes: the answer without the prompt
    token_ids: list[int] | None = None  # native probes


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
    if await _cancel_now(call, r, o):
        return
    text, ids = [], []
    async for msg in call:
        o.messages += 1
        ids += msg.token_ids
        text.append(msg.text)
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            o.finish_reason = pb.FinishReason.Name(msg.finish_reason)
            o.completion_tokens = msg.usage.completion_tokens
        if await _cancel_after(call, r, o):
            return
    o.tokens = len(ids)
    _keep_text(o, r, "".join(text))
    if r["probe"] is not None:
        o.token_ids = ids


async def _kserve_unary(stub: kpb_grpc.GRPCInferenceServiceStub, r: dict, o: Outcome) -> None:
    resp = await stub.ModelInfer(_kserve_request(r, stream=False), timeout=_timeout(r))
    o.messages = 1
    _keep_text(o, r, _text_output(resp))


async def _kserve_stream(stub: kpb_grpc.GRPCInferenceServiceStub, r: dict, o: Outcome) -> None:
    async def one() -> AsyncIterator[kpb.ModelInferRequest]:
        yield _kserve_request(r, stream=True)  # then the client half-closes: the server ends after it

    call = stub.ModelStreamInfer(one(), timeout=_timeout(r))
    if await _cancel_now(call, r, o):
        return
    text = []
    async for msg in call:
        o.messages += 1
        if msg.error_message:
            o.error_message = msg.error_message
            continue
        resp = msg.infer_response
        o.finals.append(resp.parameters["triton_final_response"].bool_param)
        text.append(_text_output(resp))
        if await _cancel_after(call, r, o):
            return
    if o.error_message is None:
        _keep_text(o, r, "".join(text))


async def _cancel_now(call: grpc.aio.Call, r: dict, o: Outcome) -> bool:
    """A cancel after 0 chunks: right after the call starts, before any answer."""
    if r["cancel"] == "chunks" and r["cancel_after"] == 0:
        await asyncio.sleep(0)
        call.cancel()
        o.cancelled = True
        o.status = (await call.code()).name
        return True
    return False


async def _cancel_after(call: grpc.aio.Call, r: dict, o: Outcome) -> bool:
    """A cancel mid-stream, after `cancel_after` messages; never once the last answer is in."""
    ended = o.finish_reason is not None or (o.finals and o.finals[-1])
    if r["cancel"] == "chunks" and o.messages >= r["cancel_after"] and not ended and not call.done():
        call.cancel()
        o.cancelled = True
        o.status = (await call.code()).name
        return True
    return False


RUN = {
    "native_unary": _native_unary,
    "native_stream": _native_stream,
    "kserve_unary": _kserve_unary,
    "kserve_stream": _kserve_stream,
}


async def _one(stubs: dict, r: dict) -> Outcome:
    o = Outcome(r["index"], r["kind"])
    start = time.perf_counter()
    try:
        await RUN[r["kind"]](stubs["kserve" if r["kind"].startswith("kserve") else "native"], r, o)
    except grpc.aio.AioRpcError as err:
        o.status = err.code().name
        o.error_message = o.error_message or err.details()
    o.seconds = time.perf_counter() - start
    return o


async def _main(
    address: str, streams: list[list[dict]], channels: int, go: object, out: object, done: object
) -> list[dict]:
    # separate connections, so that the server's fronts (SO_REUSEPORT) each get some
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 * 1024**2)]
    chans = [grpc.aio.insecure_channel(address, options=opts) for _ in range(channels)]
    for c in chans:
        await c.channel_ready()
    stubs = [{"native": pb_grpc.TandemStub(c), "kserve": kpb_grpc.GRPCInferenceServiceStub(c)} for c in chans]
    out.put("ready")
    await asyncio.get_running_loop().run_in_executor(None, go.wait)  # every client starts at once
    results: list[Outcome] = []

    async def stream(i: int, requests: list[dict]) -> None:
        for r in requests:
            results.append(await _one(stubs[i % len(stubs)], r))
            with done.get_lock():
                done.value += 1

    await asyncio.gather(*(stream(i, s) for i, s in enumerate(streams)))
    for c in chans:
        await c.close()
    return [asdict(o) for o in results]


def run_client(
    address: str, streams: list[list[dict]], channels: int, go: object, out: object, done: object
) -> None:
    """Process entry point: "ready" once connected, then (after `go` is set) the outcomes, on `out`;
    `done` counts finished requests as they finish (the parent watches it for progress and hangs)."""
    out.put(asyncio.run(_main(address, streams, channels, go, out, done)))
