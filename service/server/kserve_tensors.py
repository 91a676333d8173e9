
"""Reading and writing KServe v2 tensors (typed contents or raw little-endian bytes)."""

from __future__ import annotations

import struct

from tandem.kserve import grpc_service_pb2 as pb

from ..contract import invalid


def _raw_bytes_elements(raw: bytes) -> list[bytes]:
    """BYTES tensors in raw form: each element is a 4-byte little-endian length, then the bytes."""
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise invalid("malformed BYTES tensor: truncated length prefix")
        (n,) = struct.unpack_from("<I", raw, i)
        i += 4
        if i + n > len(raw):
            raise invalid("malformed BYTES tensor: element runs past the end")
        out.append(raw[i : i + n])
        i += n
    return out


def read_inputs(request: pb.ModelInferRequest) -> dict[str, list]:
    """name -> flat list of Python values, whichever encoding the client used."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise invalid("raw_input_contents must have one entry per input")
    values: dict[str, list] = {}
    for i, t in enumerate(request.inputs):
        dt = t.datatype
        if raw:
            data = raw[i]
            if dt == "BYTES":
                v: list = _raw_bytes_elements(data)
            elif dt == "BOOL":
                v = [b != 0 for b in data]
            elif dt in ("INT32", "INT64", "UINT32", "UINT64"):
                fmt = {"INT32": "i", "INT64": "q", "UINT32": "I", "UINT64": "Q"}[dt]
                size = struct.calcsize(fmt)
                if len(data) % size:
                    raise invalid(f"input {t.name!r}: {len(data)} bytes is not a whole number of {dt}")
                v = list(struct.unpack(f"<{len(data) // size}{fmt}", data))
            else:
                raise invalid(f"input {t.name!r}: datatype {dt} is not accepted")
        else:
            c = t.contents
            v = {
                "BYTES": list(c.bytes_contents),
                "BOOL": list(c.bool_contents),
                "INT32": list(c.int_contents),
                "INT64": list(c.int64_contents),
                "UINT32": list(c.uint_contents),
                "UINT64": list(c.uint64_contents),
            }.get(dt)
            if v is None:
                raise invalid(f"input {t.name!r}: datatype {dt} is not accepted")
        values[t.name] = v
    return values


def bytes_output(name: str, items: list[bytes]) -> tuple[pb.ModelInferResponse.InferOutputTensor, bytes]:
    """A BYTES output tensor and its raw contents."""
    raw = b"".join(struct.pack("<I", len(x)) + x for x in items)
    return pb.ModelInferResponse.InferOutputTensor(name=name, datatype="BYTES", shape=[len(items)]), raw
