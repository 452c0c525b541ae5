"""Safe by default: loopback-only binding unless a key is set, a Host-header allowlist against
DNS rebinding, a constant-time API key check and a request body size limit (ASGI middleware)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from typing import Iterable

from starlette.exceptions import HTTPException

from .errors import error_body

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost",
                            "ip6-loopback"})
# Reachable without a key, so that a supervisor can probe readiness.
OPEN_PATHS = frozenset({"/health"})


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


async def _send_error(send, status: int, message: str, code: str, headers=()) -> None:
    body = json.dumps(error_body(status, message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Host allowlist, API key and body size limit, checked before the app sees a request."""

    def __init__(self, app, hosts: HostAllowlist, api_key: str | None, max_body: int):
        """Args:
            app: the ASGI app to guard.
            hosts: allowed Host headers.
            api_key: the bearer token every request but /health must carry, or None.
            max_body: largest request body in bytes.
        """
        self.app = app
        self.hosts = hosts
        # Digests of equal length, so that the comparison reveals not even the key's length.
        self.key = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = _header(scope, b"host")
        if not self.hosts.allows(host):
            return await _send_error(
                send, 403, f"Host {host!r} is not allowed; start the server with "
                           "--allow-host NAME to accept it", "host_not_allowed")
        if self.key is not None and scope["method"] != "OPTIONS" \
                and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            return await _send_error(send, 401, "a valid API key is needed: send "
                                     "'Authorization: Bearer KEY'", "invalid_api_key",
                                     [(b"www-authenticate", b"Bearer")])
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send_error(send, 413, self._too_large(), "request_too_large")
        await self.app(scope, self._limited(receive, send), send)

    def _authorized(self, scope) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        # compare_digest takes time independent of where the two differ
        return hmac.compare_digest(hashlib.sha256(given).digest(), self.key)

    def _too_large(self) -> str:
        return f"the request body exceeds {self.max_body} bytes (--max-body)"

    def _limited(self, receive, send):
        """receive() that stops a chunked body once it passes the limit."""
        seen = 0

        async def wrapped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge(self._too_large())
            return message
        return wrapped


class BodyTooLarge(HTTPException):
    """A chunked body passed the size limit while being read (an HTTPException, which the
    framework lets through its body parsing unchanged)."""

    def __init__(self, message: str):
        super().__init__(413, message)
