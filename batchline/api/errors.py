"""The API's errors: each is an HTTP status and OpenAI's error body, ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any

from batchline.exceptions import BatchlineError


class ApiError(BatchlineError):
    """An answer other than 2xx. The message never quotes an API key."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(kind: str, object_id: str, param: str = "id") -> ApiError:
    return ApiError(404, f"No such {kind} object: {object_id}", param=param)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


class FileContentLost(BatchlineError):
    """The chunks of a file are not all on its topic any more (deleted meanwhile, or removed by retention)."""

    def __init__(self, file_id: str, found: int, expected: int) -> None:
        super().__init__(f"file {file_id}: {found} of its {expected} content chunks are on the topic")
