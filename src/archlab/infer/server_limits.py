"""What lets ``archlab serve`` face a network: the API key, the limits on each request's work,
the listening socket bound before anything says the server is up.

* ``ServerLimits``: the key (``--api-key`` / ``ARCHLAB_API_KEY``), the body size limit, the wait
  queue's bound and the per-request time limit.
* ``Guard``: ASGI middleware in front of every route. Without the key every route but
  ``/health`` answers 401 (before the request reaches the app, so an unauthenticated client costs
  no parsing); a body over the limit answers 413, from its Content-Length before anything is
  read, or as soon as a chunked body passes the limit.
* ``bind``: the socket, bound before the warm-up (a port in use fails in one line, before the
  compilations and the "serving" line), listened on only when the server is ready.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import json
import socket
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from archlab.errors import ArchlabError, UsageError

API_KEY_ENV = "ARCHLAB_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # answered without the key: a load balancer's probe carries none
# Seconds a refused client is told to wait: short, as slots free continuously while requests end
# (the openai client waits this long before its retries).
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerLimits:
    """``api_key``: required as ``Authorization: Bearer KEY`` (None: no key). ``max_body_bytes``:
    the largest request body. ``max_queue``: requests that may wait for a slot; one more is
    refused with 429. ``request_timeout``: seconds from a request's arrival to its end, the wait
    for a slot included (None: no limit)."""

    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_queue: int = 256
    request_timeout: float | None = 600.0

    def check(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise UsageError(f"the API key is empty (--api-key or {API_KEY_ENV}); give a key or leave both unset")
        if self.max_body_bytes < 1:
            raise UsageError(f"--max-body-bytes must be at least 1, got {self.max_body_bytes}")
        if self.max_queue < 0:
            raise UsageError(f"--max-queue must be at least 0, got {self.max_queue}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise UsageError(f"--request-timeout must be above 0 seconds (0 on the command line: no limit), "
                             f"got {self.request_timeout}")


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object, which its clients parse into their exceptions."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


async def send_json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


class BodyTooLarge(Exception):
    """A chunked request body passed ``--max-body-bytes`` while the app was reading it."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)")


class Guard:
    """The API key and the body size limit, for every route of ``app``; ``count(outcome)`` is
    told of each refusal (the metrics)."""

    def __init__(self, app, limits: ServerLimits, count: Callable[[str], None] = lambda outcome: None):
        self.app, self.limits, self.count = app, limits, count
        # Keys are compared as SHA-256 digests: equal lengths, so hmac.compare_digest's time
        # depends on neither the key's content nor its length.
        self.key_digest = None if limits.api_key is None else hashlib.sha256(limits.api_key.encode()).digest()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = given.strip().partition(b" ")
        same = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.key_digest)
        return same and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if self.key_digest is not None and scope["path"] not in OPEN_PATHS and not self.authorized(headers):
            self.count("unauthorized")
            return await send_json(send, 401, error_body(
                "a valid API key is required: send the header Authorization: Bearer KEY", code="invalid_api_key"),
                {"www-authenticate": "Bearer"})
        limit = self.limits.max_body_bytes
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self.count("too_large")
            return await send_json(send, 413, error_body(str(BodyTooLarge(limit)), code="request_too_large"))
        received = 0

        async def counted() -> dict[str, Any]:  # a chunked body declares no length: count it as it comes
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: one the system picks), not yet listening:
    until it listens a connection is refused, so clients never wait on a server still loading.
    A failure (the port in use, an address not on this machine, a host that does not resolve) is
    one line."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ArchlabError(f"cannot listen on {host}:{port}: the host does not resolve ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn does: a restarted server may bind while the old one's connections linger in
        # TIME_WAIT; a socket still listening there refuses the bind all the same.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = (e.strerror or str(e)).lower()
        hint = " (another server is there: stop it or choose another --port)" if e.errno == errno.EADDRINUSE else ""
        raise ArchlabError(f"cannot listen on {host}:{port}: {why}{hint}") from None
    return sock


def listening_url(sock: socket.socket) -> str:
    """The base URL of a bound socket (an IPv6 address in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def exposure_warning(sock: socket.socket, api_key: str | None) -> str | None:
    """The warning for a server that other machines can reach and that has no key, else None."""
    host = sock.getsockname()[0]
    if api_key is not None or ipaddress.ip_address(host.split("%")[0]).is_loopback:
        return None
    return (f"archlab: warning: listening on {host}, which other machines can reach, without an API key: anyone "
            f"who reaches the port can use the model (set --api-key or {API_KEY_ENV})")
