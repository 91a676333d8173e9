"""Request errors the front raises; the gRPC layers map `kind` to a status code."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"


class RequestError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(ErrorKind.INVALID_ARGUMENT, message)
