"""The stack's blocking HTTP client: one place for timeouts, headers and error wording.

Blocking one-shot calls (the CLI, the exporter's scrapes, benchmarks' memory probes, the demo,
tests) use this, on the standard library; the long-lived async paths (the entry point's proxy,
the fleet's probes, load generators) use aiohttp. Nothing else speaks HTTP.
"""
from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


class HttpUnreachable(OSError):
    """No HTTP answer: refused, timed out, reset, bad host. The message names the URL."""


@dataclass
class HttpResponse:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(url: str, *, method: str = "GET", json_body: Any = None,
                 headers: dict[str, str] | None = None, timeout_s: float = 10.0,
                 max_bytes: int = 64 << 20) -> HttpResponse:
    """One request; any HTTP status is an answer (returned), no answer raises HttpUnreachable."""
    data = None
    hdrs = dict(headers or {})
    if json_body is not None:
        data = json.dumps(json_body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 (http only)
            return HttpResponse(resp.status, resp.read(max_bytes))
    except urllib.error.HTTPError as exc:
        return HttpResponse(exc.code, exc.read(max_bytes))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise HttpUnreachable(f"{url}: no answer ({reason})") from None


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
