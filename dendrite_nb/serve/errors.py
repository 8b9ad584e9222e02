"""The server's typed error: an HTTP status with the OpenAI-style error body that goes with it."""
from __future__ import annotations

from typing import Any

from ..errors import DendriteError


class APIError(DendriteError):
    """A request the server refuses. `body()` is what the client reads, in OpenAI's shape:
    {"error": {"message", "type", "param", "code"}}; `param` names the request field at fault (dotted, with
    list indices in brackets: "messages[2].content"), or is None when no one field is."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error"):
        self.message, self.param, self.code, self.status, self.error_type = message, param, code, status, error_type
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}
