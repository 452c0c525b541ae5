"""Safe by default: loopback-only binding unless a key is set, a Host-header allowlist against
DNS rebinding, a constant-time API key check, a request body size limit (ASGI middleware) and
deadlines for a request's head and body (a slow client cannot hold a connection)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
from typing import Iterable

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import anthropic_error_body, error_body

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost",
                            "ip6-loopback"})
# Reachable without a key, so that a supervisor can probe readiness.
OPEN_PATHS = frozenset({"/health"})
# Anthropic's API: its clients send the key as x-api-key and read errors in its shape.
ANTHROPIC_PATHS = ("/v1/messages",)


def is_loopback(host: str) -> bool:
    """Whether a host name or address only reaches this machine."""
    h = host.strip("[]").lower().rstrip(".")
    if h in LOOPBACK_NAMES or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host part of a Host header: 'a:80' -> 'a', '[::1]:80' -> '::1'."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        h = h.split(":")[0]
    return h.rstrip(".")


class HostAllowlist:
    """Names and addresses the Host header may carry. A web page that rebinds its own DNS
    name to 127.0.0.1 still sends that name, so it is refused here; loopback names and
    addresses are always allowed, the rest only when listed (``*`` allows any)."""

    def __init__(self, extra: Iterable[str] = ()):
        self.extra = {host_of(h) for h in extra if h}
        self.any = "*" in {h.strip() for h in extra}

    def allows(self, header: str | None) -> bool:
        if header is None or self.any:  # no Host: not a browser (browsers always send it)
            return True
        h = host_of(header)
        return is_loopback(h) or h in self.extra


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


async def _send_error(send, status: int, message: str, code: str, headers=(),
                      path: str = "") -> None:
    if path.startswith(ANTHROPIC_PATHS):
        body = json.dumps(anthropic_error_body(status, message)).encode()
    else:
        body = json.dumps(error_body(status, message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Host allowlist, API key and body size limit, checked before the app sees a request."""

    def __init__(self, app, hosts: HostAllowlist, api_key: str | None, max_body: int,
                 body_timeout: float = 30.0):
        """Args:
            app: the ASGI app to guard.
            hosts: allowed Host headers.
            api_key: the bearer token every request but /health must carry, or None.
            max_body: largest request body in bytes.
            body_timeout: seconds the client may pause while sending the body (408 after).
        """
        self.app = app
        self.hosts = hosts
        # Digests of equal length, so that the comparison reveals not even the key's length.
        self.key = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.max_body = max_body
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = _header(scope, b"host")
        if not self.hosts.allows(host):
            return await _send_error(
                send, 403, f"Host {host!r} is not allowed; start the server with "
                           "--allow-host NAME to accept it", "host_not_allowed",
                path=scope["path"])
        if self.key is not None and scope["method"] != "OPTIONS" \
                and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            return await _send_error(send, 401, "a valid API key is needed: send "
                                     "'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                                     "invalid_api_key", [(b"www-authenticate", b"Bearer")],
                                     path=scope["path"])
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send_error(send, 413, self._too_large(), "request_too_large",
                                     path=scope["path"])
        await self.app(scope, self._limited(receive, send), send)

    def _authorized(self, scope) -> bool:
        auth = _header(scope, b"authorization")
        if auth is None:   # Anthropic's clients send the key in a header of its own
            given = (_header(scope, b"x-api-key") or "").strip().encode()
        else:
            scheme, _, token = auth.partition(" ")
            given = token.strip().encode() if scheme.lower() == "bearer" else b""
        # compare_digest takes time independent of where the two differ
        return hmac.compare_digest(hashlib.sha256(given).digest(), self.key)

    def _too_large(self) -> str:
        return f"the request body exceeds {self.max_body} bytes (--max-body)"

    def _limited(self, receive, send):
        """receive() that stops a chunked body once it passes the limit, and a body whose
        next part takes longer than the body timeout to come. Once the body is whole,
        receive() is left alone: a streaming response waits on it for the disconnect."""
        seen = 0
        whole = False

        async def wrapped():
            nonlocal seen, whole
            if whole:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                raise BodyError(408, f"the request body did not arrive within "
                                     f"{self.body_timeout:g} s") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyError(413, self._too_large())
                whole = not message.get("more_body", False)
            return message
        return wrapped


class BodyError(HTTPException):
    """A body too large or too slow, found while it is read (an HTTPException, which the
    framework lets through its body parsing unchanged)."""


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's head: a client that
    trickles its request line and headers (slowloris) is disconnected when it passes, so
    idle or slow connections cannot pile up. Idle keep-alive connections already close
    after uvicorn's keep-alive timeout."""

    header_timeout: float = 10.0   # set per server by ``guarded_protocol``

    def connection_made(self, transport) -> None:  # noqa: D102
        super().connection_made(transport)
        self._head_deadline = None
        self._arm()

    def on_response_complete(self) -> None:  # noqa: D102
        super().on_response_complete()
        self._arm()   # a kept-alive connection's next request gets its own deadline

    def connection_lost(self, exc) -> None:  # noqa: D102
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.header_timeout, self._head_late)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        # their_state leaves IDLE once a request's head is complete
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's ``http`` setting, with this server's deadline."""
    return type("GuardedH11", (GuardedH11Protocol,), {"header_timeout": header_timeout})
