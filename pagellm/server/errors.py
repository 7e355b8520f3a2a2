"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def body_timeout(timeout: float) -> APIError:
    """A request body still arriving after ``timeout`` seconds (--client-body-timeout)."""
    return APIError(408, f"the request body did not arrive within {timeout:g} s")


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code),
        status_code=err.status,
        headers=err.headers,
    )


def quoted_name(name: object, most: int = 100) -> str:
    """A client-given name (a model, say) as an error message shows it: quoted, and cut to
    ``most`` characters so an answer never echoes a whole body back."""
    text = repr(name)
    return text if len(text) <= most else text[:most] + "..."
