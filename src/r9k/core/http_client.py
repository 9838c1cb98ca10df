"""The stack's blocking HTTP client: one place for timeouts, headers and error wording.

Blocking one-shot calls (the CLI, the exporter's scrapes, benchmarks' memory probes, the demo,
tests) use this, on the standard library; the long-lived async paths (the entry point's proxy,
the fleet's probes, load generators) use aiohttp. Nothing else speaks HTTP.
"""
from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class HttpUnreachable(OSError):
    """No HTTP answer: refused, timed out, reset, bad host. The message names the URL."""


class HttpDeadline(HttpUnreachable):
    """No complete answer within the request's time."""


@dataclass
class HttpResponse:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def _cut(conn: http.client.HTTPConnection, held: list) -> None:
    """The deadline passed: shut the socket, which ends any recv or send blocked on it (the one
    connected, kept aside: http.client hands it to the response and forgets it when the answer
    ends with the connection)."""
    sock = held[0] if held else conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def http_request(url: str, *, method: str = "GET", json_body: Any = None,
                 headers: dict[str, str] | None = None, timeout_s: float = 10.0,
                 max_bytes: int = 64 << 20) -> HttpResponse:
    """One request; any HTTP status is an answer (returned), no answer raises HttpUnreachable.
    ``timeout_s`` bounds the whole exchange (connecting, sending, the headers and every byte of
    the body), not each read: a server that trickles its answer cannot hold the caller, or its
    thread, longer. A body over ``max_bytes`` is cut there."""
    data = None
    hdrs = dict(headers or {})
    hdrs.setdefault("Connection", "close")
    if json_body is not None:
        data = json.dumps(json_body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    try:
        parts = urlsplit(url)
        port = parts.port
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http(s)://host[:port] URL")
    except ValueError as exc:
        raise HttpUnreachable(f"{url}: no answer ({exc})") from None
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, port, timeout=timeout_s)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    deadline = time.monotonic() + timeout_s
    held: list = []
    timer = threading.Timer(timeout_s, _cut, args=(conn, held))
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        held.append(conn.sock)
        conn.request(method, target, body=data, headers=hdrs)
        resp = conn.getresponse()
        chunks, size = [], 0
        while size < max_bytes:
            chunk = resp.read(min(1 << 16, max_bytes - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if time.monotonic() >= deadline:  # cut by the timer: what came is not the whole answer
            raise TimeoutError
        return HttpResponse(resp.status, b"".join(chunks))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if time.monotonic() >= deadline or isinstance(exc, TimeoutError):
            raise HttpDeadline(f"{url}: no complete answer within {timeout_s:g} s") from None
        raise HttpUnreachable(f"{url}: no answer ({exc or type(exc).__name__})") from None
    finally:
        timer.cancel()
        conn.close()


def http_get(url: str, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None,
             max_bytes: int = 64 << 20) -> bytes:
    """The body of a 200 answer; another status raises HttpUnreachable naming it."""
    resp = http_request(url, headers=headers, timeout_s=timeout_s, max_bytes=max_bytes)
    if resp.status != 200:
        raise HttpUnreachable(f"{url}: HTTP {resp.status}: {resp.text[:200]}")
    return resp.body


def host_url(host: str, port: int, scheme: str = "http") -> str:
    """``scheme://host:port`` with an IPv6 literal in brackets (RFC 3986): ``http://[::1]:8100``,
    not ``http://::1:8100``, which no client parses."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, ``localhost``): what the
    entry point and the exporter may serve on without a key or auth."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"
