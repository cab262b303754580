"""`ApiError`: a request the server refuses, answered with an OpenAI-style JSON error body.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p",
               "code": null}, "object": "error"}

The status says what went wrong: 400 (bad input), 401 (missing or wrong API key), 404 (unknown
model or route), 405, 413 (body too large), 503 (overloaded or shutting down), 500 (a failure of
ours; the server goes on serving).
"""

from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict:
    kind = _TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")
    return {
        "object": "error",
        "error": {"message": message, "type": kind, "param": param, "code": code},
    }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)
