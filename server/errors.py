"""Errors both fronts answer with: one kind per failure, mapped onto a gRPC status code and
onto an HTTP status with OpenAI's error JSON, so a refusal reads the same over either API."""

from __future__ import annotations

import dataclasses
import enum


class ErrorKind(enum.Enum):
    # value: (gRPC status code name, HTTP status, OpenAI error type)
    INVALID = ("INVALID_ARGUMENT", 400, "invalid_request_error")
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401, "authentication_error")
    NOT_FOUND = ("NOT_FOUND", 404, "invalid_request_error")
    TOO_LARGE = ("INVALID_ARGUMENT", 413, "invalid_request_error")
    EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, "rate_limit_error")
    UNAVAILABLE = ("UNAVAILABLE", 503, "service_unavailable_error")
    INTERNAL = ("INTERNAL", 500, "server_error")

    @property
    def grpc_code_name(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]


@dataclasses.dataclass
class ServeError(Exception):
    """A request refused or failed. `param`: the request field at fault (OpenAI's `param`);
    `code`: a short machine-readable reason (OpenAI's `code`, the refusal counter's label)."""

    kind: ErrorKind
    message: str
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def openai_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind.openai_type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ServeError:
    return ServeError(ErrorKind.INVALID, message, param, code)
