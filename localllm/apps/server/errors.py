"""Errors in the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``, with honest
status codes and never a traceback or a file path in the body; the engine's typed errors
become these through one table, ERROR_STATUS."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from localllm.errors import (BadSetting, ConstraintError, ContextFull, EmptyPrompt, GrammarError,
                             KVPoolFull, LocalLLMError, PromptTooLong, TemplateError,
                             TokenizerError, TokenOutOfVocab)
from localllm.generation.sampling import SamplingParams

log = logging.getLogger("localllm.apps.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """A request the server refuses, with what the client needs to know to fix it."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    """The OpenAI error object for a status and message."""
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


# Anthropic's error types by HTTP status, for /v1/messages
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error object, ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(
        status, "invalid_request_error" if 400 <= status < 500 else "api_error"),
        "message": message}}


def _too_long(e: PromptTooLong, param: str | None) -> str:
    if not e.n_tokens:
        return _first_line(e)
    return (f"the prompt has {e.n_tokens} tokens but the context holds {e.ctx}; shorten it, "
            "or restart the server with a larger --ctx-size")


@dataclass(frozen=True)
class Status:
    """How the server answers one class of the engine's errors."""
    status: int
    code: str
    # The message from the error and the request field; None: the error's first line.
    message: Callable[[LocalLLMError, str | None], str] | None = None


# The engine's error classes -> HTTP status and OpenAI error code. An error takes the row of
# the nearest class in its method resolution order, so subclasses come with their own row
# only where they answer differently.
ERROR_STATUS: dict[type[LocalLLMError], Status] = {
    PromptTooLong: Status(400, "context_length_exceeded", _too_long),
    ContextFull: Status(400, "context_length_exceeded"),
    TokenOutOfVocab: Status(400, "invalid_value"),
    EmptyPrompt: Status(400, "invalid_value"),
    BadSetting: Status(400, "invalid_value"),
    GrammarError: Status(400, "unsupported_schema", lambda e, param: f"{param}: {_first_line(e)}"),
    ConstraintError: Status(400, "invalid_value"),
    TemplateError: Status(400, "invalid_value"),
    TokenizerError: Status(400, "invalid_value"),
    KVPoolFull: Status(400, "invalid_value"),
    LocalLLMError: Status(400, "invalid_value"),   # any other refusal of the engine's
}

# The engine's ``param`` names reach the client only where they are request fields too (the
# sampling settings); the server names the request field of a prompt itself.
_REQUEST_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or ["invalid request"])[0]


def api_error(exc: LocalLLMError, param: str | None = None) -> APIError:
    """The answer to an engine error, by ERROR_STATUS.

    Args:
        exc: the error.
        param: the request field at fault; None: the error's own ``param`` where that names
            a request field.
    Returns:
        The APIError to raise or deliver.
    """
    row = next(ERROR_STATUS[c] for c in type(exc).__mro__ if c in ERROR_STATUS)
    if param is None and exc.param in _REQUEST_FIELDS:
        param = exc.param
    message = row.message(exc, param) if row.message else _first_line(exc)
    return APIError(row.status, message, row.code, param)


def request_error(e: BaseException) -> APIError:
    """What a client is told when its request fails (details of a bug stay in the log): an
    APIError as it is, an engine error by ERROR_STATUS, any other ValueError as a 400."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, LocalLLMError):
        return api_error(e)
    if isinstance(e, ValueError):
        return APIError(400, _first_line(e), "invalid_value")
    log.error("internal error while serving a request", exc_info=e)
    return APIError(500, "internal server error", "internal_error")


def busy(message: str, retry_after: int = 1) -> APIError:
    """503 with Retry-After: the server cannot take the request now but may soon."""
    return APIError(503, message, "server_busy", headers={"Retry-After": str(retry_after)})


# Names pydantic puts in an error's location for the branch of a union it tried.
_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'list[ContentPart]', 0) -> 'messages[0].content[0]'."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(part, str) and (part in _BRANCHES or "[" in part or "-" in part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error as one line, and the parameter it concerns."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # A union's failed branches each report; the one our own validators wrote says most.
    e = next((x for x in errors if x.get("type") == "value_error"), errors[0])
    param = _param(tuple(e.get("loc", ())))
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    msg = str(e.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    has_input = "input" in e and e.get("type") not in ("missing", "model_attributes_type")
    got = f" (got {_short(e['input'])})" if has_input and not isinstance(e["input"], dict) else ""
    return (f"{param}: {msg}{got}" if param else msg), param


def install_handlers(app: FastAPI) -> None:
    """Every error the app can raise leaves it in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(LocalLLMError)
    async def _engine_error(request: Request, exc: LocalLLMError):
        return api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return APIError(400, message, "invalid_value", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        messages = {404: f"no such endpoint: {request.method} {request.url.path}",
                    405: f"method {request.method} is not allowed on {request.url.path}"}
        message = messages.get(exc.status_code, str(exc.detail))
        code = {408: "request_timeout", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, message, code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # The details stay in the server's log; the client gets no traceback or path.
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", "internal_error").response()
