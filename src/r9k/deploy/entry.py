"""The fleet's one OpenAI-compatible endpoint: routes each request to a ready replica of its model
by the fleet's routing policy (`r9k.deploy.routing`: pool-aware by default; streaming passes
through), answers 503 with the replica states when none is ready, serves the fleet status
(``r9k.core.fleet_status.FleetStatus``, the model the exporter reads) and the admin actions.

It knows replicas only through :class:`Backend` (the controller, or a table in tests).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from r9k.deploy.routing import EngineLoad, choose, prefix_key
from r9k.core.fleet_status import FleetStatus

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
               "content-encoding", "authorization", "upgrade"}


@dataclass
class Route:
    """A ready replica as the router sees it; ``outstanding`` is the router's own count."""

    name: str
    model: str
    url: str
    outstanding: int = 0
    served: int = 0
    last_pick: int = 0          # router's pick counter when this replica was last chosen
    api_key: str | None = field(default=None, repr=False)
    engine: EngineLoad | None = None  # the engine's own state, from the controller's probe
    refused_until: float = 0.0  # monotonic: refused a connection; skipped until then
    aborted: str | None = None  # why its in-flight requests were ended (unhealthy, released)
    host: str | None = None     # the replica's host: a retry goes to another host first
    waiters: set = field(default_factory=set, repr=False)  # one future per request in flight

    def abort(self, reason: str) -> None:
        """End every request in flight to this replica now (a plain one that got no byte yet
        goes to another replica; a stream ends with an error event)."""
        if self.aborted is None:
            self.aborted = reason
        for fut in list(self.waiters):
            if not fut.done():
                fut.set_result(reason)

    def watch(self) -> "asyncio.Future[str]":
        """A future that resolves (with the reason) when this route is aborted."""
        fut = asyncio.get_running_loop().create_future()
        if self.aborted is not None:
            fut.set_result(self.aborted)
        else:
            self.waiters.add(fut)
        return fut


class UpstreamLost(aiohttp.ClientConnectionError):
    """The replica did not answer within a bound, or was aborted (unhealthy, host lost)."""


async def bounded(aw, timeout_s: float, gone: "asyncio.Future[str]", what: str):
    """``aw``'s result, unless ``timeout_s`` passes first or ``gone`` resolves: UpstreamLost."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    if gone.done():
        raise UpstreamLost(f"aborted while waiting for {what}: {gone.result()}")
    raise UpstreamLost(f"no {what} within {timeout_s:g} s")


class Backend(Protocol):
    def routes(self, model: str) -> list[Route]: ...          # ready replicas of the model
    def model_names(self) -> list[str]: ...                    # every model in the fleet
    def max_model_len(self, model: str) -> int | None: ...     # as vLLM's /v1/models says it
    def states_line(self, model: str) -> str: ...              # "m-0 loading, m-1 unhealthy (why)"
    def status(self) -> FleetStatus: ...
    async def admin(self, action: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]: ...


MAX_JSON_DEPTH = 64
MAX_BODY_BYTES = 64 << 20      # 413 above


class JsonDepth:
    """Nesting depth of a JSON text fed in pieces, as bytes arrive: brackets outside strings,
    bounded at MAX_JSON_DEPTH before the recursive parser ever sees the text (it would recurse
    until RecursionError, a 500). Escaped backslashes and quotes are cut first (`\\` then `\"`,
    left to right as a string reads them; an odd backslash at a piece's end waits for the next),
    then everything but quotes and brackets, all at C speed: the loop sees only those."""

    _DELETE = bytes(b for b in range(256) if b not in b'"[]{}')

    def __init__(self) -> None:
        self.depth = self.deepest = 0
        self.in_string = False
        self._carry = b""

    def feed(self, piece: bytes) -> None:
        piece, self._carry = self._carry + piece, b""
        run = len(piece) - len(piece.rstrip(b"\\"))
        if run % 2:
            piece, self._carry = piece[:-1], b"\\"
        piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        depth, deepest, in_string = self.depth, self.deepest, self.in_string
        for ch in piece.translate(None, self._DELETE):
            if ch == 0x22:           # quote
                in_string = not in_string
            elif in_string:
                continue
            elif ch in (0x5B, 0x7B):
                depth += 1
                if depth > deepest:
                    deepest = depth
                    if deepest > MAX_JSON_DEPTH:
                        raise ValueError("nested too deep")
            else:
                depth -= 1
        self.depth, self.deepest, self.in_string = depth, deepest, in_string


def _json_object(body: bytes, checked: bool = False) -> dict[str, Any]:
    """A request body as a JSON object; ValueError for anything else: not UTF-8, not JSON, not
    an object, or nested deeper than MAX_JSON_DEPTH (`checked`: JsonDepth has seen it already)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError("not UTF-8") from exc
    if not checked:
        JsonDepth().feed(body)
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


class BodyTooLarge(ValueError):
    pass


BODY_PIECE_BYTES = 256 << 10


async def _read_body(request: web.Request, depth: JsonDepth) -> bytes:
    """The request body, read in pieces with the event loop free between them (a 60 MiB body
    once held every other client for seconds while it was scanned in one go); each piece is
    depth-checked as it arrives. BodyTooLarge over MAX_BODY_BYTES, ValueError too deep."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise BodyTooLarge(f"{request.content_length} bytes")
    pieces, size = [], 0
    async for piece in request.content.iter_chunked(BODY_PIECE_BYTES):
        size += len(piece)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(f"over {MAX_BODY_BYTES} bytes")
        depth.feed(piece)
        pieces.append(piece)
        await asyncio.sleep(0)
    return b"".join(pieces)


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _too_large(exc: BodyTooLarge) -> web.Response:
    response = _error(413, f"request body too large ({exc}); expected at most {MAX_BODY_BYTES} "
                      "bytes", "RequestEntityTooLarge")
    response.force_close()  # the rest of the body is not read: the connection cannot carry another
    return response


class _ConnectionCollector:
    """The connection guard's counts: open connections and why connections were closed."""

    def __init__(self, entry: "EntryPoint") -> None:
        self.entry = entry

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        site = self.entry.site
        closed = CounterMetricFamily(
            "r9k_entry_connections_closed", "Connections the entry point closed: refused_peer (the "
            "address had its limit), refused_full (every slot inside a request), evicted (an idle "
            "or head-arriving connection gave its slot to a new one), header_timeout",
            labels=["reason"])
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], site.closed[reason] if site else 0)
        yield closed
        yield GaugeMetricFamily("r9k_entry_open_connections", "Client connections open now",
                                value=site.open_connections if site else 0)


class EntryPoint:
    def __init__(self, backend: Backend, api_key: str | None = None, routing: str = "pool-aware",
                 prefix_chars: int = 1024, connect_timeout_s: float = 5.0,
                 first_byte_timeout_s: float = 600.0, chunk_timeout_s: float = 60.0) -> None:
        self.backend = backend
        self.api_key = api_key
        for name, value in (("connect_timeout_s", connect_timeout_s),
                            ("first_byte_timeout_s", first_byte_timeout_s),
                            ("chunk_timeout_s", chunk_timeout_s)):
            if not value > 0:
                raise ValueError(f"EntryPoint {name} {value!r}: expected seconds > 0")
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.body_timeout_s = BODY_TIMEOUT_S
        choose([], routing, 0.0)  # a bad policy name fails here, at start
        self.routing = routing
        self.prefix_chars = prefix_chars
        # every /v1 request ends as exactly one outcome; retries are counted on the side
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "r9k_entry_requests", "Requests through the entry point by outcome: served (2xx), "
            "rejected (4xx: bad request, key, unknown model, or the replica's 4xx), errored (5xx "
            "from the entry point or a replica), broken (a replica died after the answer "
            "started: a stream ends with an error event), cancelled (the client left "
            "mid-stream)", ["outcome"], registry=self.registry)
        self.retries = Counter("r9k_entry_retries", "Requests sent again to another replica "
                               "because the first dropped them before answering",
                               registry=self.registry)
        self.routed = Counter("r9k_entry_routed", "Requests sent to each replica",
                              ["replica"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.registry.register(_ConnectionCollector(self))
        self.session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_request_slots])
        self.site: "_GuardedSite | None" = None  # set by serve(): its connection counts
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/v1/{tail:.*}", self.proxy)
        self.app.router.add_get("/fleet/status", self.status)
        self.app.router.add_post("/fleet/{action}", self.admin)
        self.app.on_startup.append(self._open)
        self.app.on_cleanup.append(self._close)

    async def _open(self, _app) -> None:
        # No keep-alive upstream: a POST on a pooled connection the replica already closed fails
        # with ServerDisconnected and is not retried; a fresh connection costs little next to a
        # completion.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            # no total: a long stream is fine while chunks keep coming (bounded() per wait)
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s,
                                          sock_connect=self.connect_timeout_s),
            auto_decompress=False)

    async def _close(self, _app) -> None:
        if self.session:
            await self.session.close()

    def _authorized(self, request: web.Request) -> bool:
        if not self.api_key:
            return True
        given = request.headers.get("Authorization", "")
        # headers arrive as text with any bytes kept (surrogates): never an error here
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                   f"Bearer {self.api_key}".encode())

    async def health(self, request: web.Request) -> web.Response:
        ready = sum(len(self.backend.routes(m)) for m in self.backend.model_names())
        return web.json_response({"ready_replicas": ready}, status=200 if ready else 503)

    async def list_models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "Unauthorized")
        data = [{"id": m, "object": "model", "owned_by": "r9k-fleet",
                 "max_model_len": self.backend.max_model_len(m),
                 "ready_replicas": len(self.backend.routes(m))} for m in self.backend.model_names()]
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.backend.status().model_dump(mode="json"))

    async def admin(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "Unauthorized")
        try:
            depth = JsonDepth()
            raw = (await asyncio.wait_for(_read_body(request, depth), self.body_timeout_s)
                   if request.can_read_body else b"{}")
            body = _json_object(raw, checked=True)
        except asyncio.TimeoutError:
            return _error(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                          "RequestTimeout")
        except BodyTooLarge as exc:
            return _too_large(exc)
        except ValueError:
            return _error(400, "expected a JSON object (UTF-8, at most 64 levels deep)", "BadRequest")
        status, payload = await self.backend.admin(request.match_info["action"], body)
        return web.json_response(payload, status=status)

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        response = await self._proxy(request)
        self.requests.labels(_outcome(response)).inc()
        return response

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "Unauthorized")
        depth = JsonDepth()
        try:
            body = await asyncio.wait_for(_read_body(request, depth), self.body_timeout_s)
        except asyncio.TimeoutError:
            return _error(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                          "RequestTimeout")
        except BodyTooLarge as exc:
            return _too_large(exc)
        except ValueError:
            body = None
        try:
            if body is None:
                raise ValueError("nested too deep")
            doc = _json_object(body, checked=True)
            model = doc.get("model")
        except ValueError:
            return _error(400, "expected a JSON object with a `model` field (UTF-8, at most 64 "
                          "levels deep)", "BadRequest")
        key = prefix_key(doc, self.prefix_chars) if self.routing == "prefix-affinity" else None
        names = self.backend.model_names()
        if model not in names:
            return _error(404, f"model {model!r} is not served here; models: {', '.join(names)}", "NotFound")
        tried: dict[str, str] = {}
        failed_hosts: set[str | None] = set()
        delivered = 0  # attempts that may have reached an engine (a refused connection did not)
        while True:
            route = None
            if delivered < MAX_TRIES:
                now = time.monotonic()
                ready = [r for r in self.backend.routes(model) if r.name not in tried]
                # a retry goes to another host first: when a host is lost, all its replicas
                # fail at once, before the controller sees the host gone
                ready = [r for r in ready if r.host is None or r.host not in failed_hosts] or ready
                # a replica that just refused a connection (dead before the probe saw it) is
                # skipped for REFUSED_SKIP_S while another can take the request
                up = [r for r in ready if r.refused_until <= now] or ready
                route = choose(up, self.routing, now, key)
            if route is None:
                if tried:
                    return _error(502, f"replicas of {model!r} dropped the request before answering: "
                                  + ", ".join(f"{k} ({v})" for k, v in tried.items()), "BadGateway")
                return _error(503, f"no ready replica for model {model!r} ({self.backend.states_line(model)})",
                              "ServiceUnavailable")
            if tried:
                self.retries.inc()
            self.routed.labels(route.name).inc()
            route.outstanding += 1
            started: dict[str, web.StreamResponse] = {}
            try:
                response = await self._forward(request, route, body, started)
                route.served += 1
                return response
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                sent = started.get("response")
                if sent is not None:  # the client has (part of) an answer: never send another
                    route.served += 1
                    return sent
                # No byte of an answer reached the client (a replica that died before the health
                # probe saw it, or mid-way through a plain body, which is buffered): completions
                # have no side effects, so the next replica may take it.
                tried[route.name] = type(exc).__name__
                if route.host is not None:
                    failed_hosts.add(route.host)
                if isinstance(exc, aiohttp.ClientConnectorError):
                    # nothing was sent: any other ready replica may take it (a lost host's
                    # replicas all refuse before the controller sees the host gone)
                    route.refused_until = time.monotonic() + REFUSED_SKIP_S
                else:
                    delivered += 1
            finally:
                route.outstanding -= 1

    async def _forward(self, request: web.Request, route: Route, body: bytes,
                       started: dict) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if route.api_key:
            headers["Authorization"] = f"Bearer {route.api_key}"
        assert self.session is not None
        gone = route.watch()  # the replica turning unhealthy ends the wait at once
        try:
            upstream = await bounded(self.session.post(route.url + request.path, data=body,
                                                       headers=headers, params=request.query),
                                     self.first_byte_timeout_s, gone, "answer")
            async with upstream:
                out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
                out_headers["X-R9k-Replica"] = route.name
                if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    # a plain answer is read whole first: a replica dying mid-body raises here,
                    # before the client saw anything, and the request goes to another replica
                    data = await bounded(upstream.read(), self.chunk_timeout_s, gone, "the answer's body")
                    out_headers.pop("Content-Length", None)
                    return web.Response(status=upstream.status, body=data, headers=out_headers)
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                started["response"] = response  # bytes may reach the client from here on
                try:
                    await response.prepare(request)
                    await self._relay(upstream, response, route, gone)
                except ConnectionError:  # the client went away (aiohttp's reset error is one too)
                    if not getattr(response, "r9k_relayed", False):
                        response.r9k_client_gone = True
                return response
        finally:
            route.waiters.discard(gone)

    async def _relay(self, upstream: aiohttp.ClientResponse, response: web.StreamResponse,
                     route: Route, gone: "asyncio.Future[str]") -> None:
        """The replica's stream to the client. Reading and writing fail differently: a read
        error is the replica dying, going silent past the chunk bound or being aborted (the
        stream ends with a well-formed error event, OpenAI's shape, and [DONE]); a write error
        (ConnectionError) is the client leaving, for the caller. The first chunk may take as
        long as a first byte (a queued prompt's prefill), later ones `chunk_timeout_s`."""
        chunks = upstream.content.iter_any().__aiter__()

        async def next_chunk() -> bytes | None:
            try:
                return await chunks.__anext__()
            except StopAsyncIteration:
                return None

        timeout_s = self.first_byte_timeout_s
        while True:
            try:
                chunk = await bounded(next_chunk(), timeout_s, gone, "the next chunk")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                response.r9k_broken = True
                event = {"error": {"message": f"replica {route.name} dropped the stream "
                                              f"({type(exc).__name__}: {exc})",
                                   "type": "BadGateway", "code": 502}}
                await response.write(f"\n\ndata: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                break
            if chunk is None:
                break
            timeout_s = self.chunk_timeout_s
            await response.write(chunk)
        response.r9k_relayed = not getattr(response, "r9k_broken", False)
        await response.write_eof()


# served: answered (2xx); rejected: 4xx, by the entry point or the replica; errored: 5xx;
# broken: a stream its replica dropped mid-answer; cancelled: the client left mid-stream
OUTCOMES = ("served", "rejected", "errored", "broken", "cancelled")
# a request a replica dropped before answering goes to one other replica; connections refused
# (nothing sent) do not count, so it is tried on every ready replica before a 502
MAX_TRIES = 2
REFUSED_SKIP_S = 5.0  # a replica that refused a connection gets no requests this long


def _outcome(response: web.StreamResponse) -> str:
    if getattr(response, "r9k_broken", False):
        return "broken"
    if getattr(response, "r9k_client_gone", False):
        return "cancelled"
    if response.status < 400:
        return "served"
    return "rejected" if response.status < 500 else "errored"


# Slow, idle or greedy clients must not starve normal ones (one client holding every slot once
# locked everyone out):
# - every request's head (from its first byte, leading blank lines included, pipelined or not)
#   arrives within HEADER_TIMEOUT_S; a body within BODY_TIMEOUT_S (408); bodies over 64 MiB: 413;
# - at most MAX_CONNECTIONS are open, at most MAX_CONNECTIONS_PER_PEER from one address;
# - when every slot is taken, a new connection takes the slot of a connection that is not in a
#   request (idle keep-alive, or a head still arriving), from the address holding the most
#   connections, oldest first: under pressure an idle keep-alive lasts only until its slot is
#   needed. A connection is refused only when every slot is inside a request.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_PEER = 256
KEEPALIVE_S = 75.0
CLOSE_REASONS = ("refused_peer", "refused_full", "evicted", "header_timeout")
MAX_HEAD_BYTES = 64 << 10  # aiohttp refuses longer lines; the framer only needs the tail


class HttpFraming:
    """Where a connection's inbound bytes stand in HTTP/1.1 framing, as the guard needs it:
    between requests (``idle``), inside a request head (``in_head``: the header deadline runs),
    or inside a body (Content-Length or chunked). Sans-IO: ``feed`` the bytes in the order they
    arrive, in any pieces; ``heads`` counts the heads completed. It follows aiohttp's framing for
    well-formed requests; a malformed one gets aiohttp's 400 and the connection closes."""

    def __init__(self) -> None:
        self.state = "idle"   # idle | head | body | chunk-size | chunk-data | chunk-end | trailers
        self.heads = 0
        self._buf = b""       # head / chunk-size line / trailer bytes not yet complete
        self._left = 0        # body or chunk bytes still to come

    @property
    def in_head(self) -> bool:
        return self.state == "head"

    @property
    def idle(self) -> bool:
        return self.state == "idle"

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.state == "idle":
                self.state, self._buf = "head", b""
            if self.state == "head":
                # leading CRLFs before a request line are skipped by the parser (RFC 9112 2.2)
                # but keep the connection in a head: its deadline runs from the first byte
                self._buf += data[i:]
                i = n
                body = self._buf.lstrip(b"\r\n")
                end = body.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buf) > MAX_HEAD_BYTES:
                        self._buf = self._buf[-MAX_HEAD_BYTES:]
                    break
                head, rest = body[:end], body[end + 4:]
                self.heads += 1
                self._buf = b""
                self._start_body(head)
                data, i, n = rest, 0, len(rest)
            elif self.state == "body":
                take = min(self._left, n - i)
                self._left -= take
                i += take
                if self._left == 0:
                    self.state = "idle"
            elif self.state == "chunk-data":
                take = min(self._left, n - i)
                self._left -= take
                i += take
                if self._left == 0:
                    self.state, self._buf = "chunk-end", b""
            else:  # a line: chunk size, the CRLF after a chunk's data, or a trailer
                j = data.find(b"\n", i)
                if j < 0:
                    self._buf = (self._buf + data[i:])[-MAX_HEAD_BYTES:]
                    break
                line = (self._buf + data[i:j]).rstrip(b"\r")
                self._buf, i = b"", j + 1
                self._line(line)

    def _start_body(self, head: bytes) -> None:
        length, chunked = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length" and value.isdigit():
                length = int(value)
            elif name == b"transfer-encoding" and value.split(b",")[-1].strip() == b"chunked":
                chunked = True
        if chunked:
            self.state = "chunk-size"
        elif length > 0:
            self.state, self._left = "body", length
        else:
            self.state = "idle"

    def _line(self, line: bytes) -> None:
        if self.state == "chunk-size":
            size = line.split(b";", 1)[0].strip()
            try:
                self._left = int(size, 16)
            except ValueError:  # malformed: aiohttp answers 400 and closes
                self._left = 0
            self.state = "chunk-data" if self._left > 0 else "trailers"
        elif self.state == "chunk-end":
            self.state = "chunk-size"
        elif self.state == "trailers" and line == b"":
            self.state = "idle"


class _PeerTransport:
    """The connection's transport as aiohttp sees it, pointing back at the guard (the request
    middleware finds its connection through ``request.transport``)."""

    def __init__(self, transport: asyncio.Transport, conn: "_GuardedConnection") -> None:
        self._transport, self.r9k_conn = transport, conn

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the site's slot accounting and a header
    deadline for every request head on it."""

    def __init__(self, inner: asyncio.Protocol, site: "_GuardedSite") -> None:
        self.inner, self.site = inner, site
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.framing = HttpFraming()
        self.counted = False
        self.in_requests = 0    # heads complete whose handler has not finished
        self.peer = ""
        self.since = 0.0        # monotonic: opened, or last became evictable

    @property
    def evictable(self) -> bool:
        """Not inside a request: idle between requests, or its head still arriving."""
        return self.in_requests == 0 and (self.framing.idle or self.framing.in_head)

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self.site.admit(self):
            transport.close()
            return
        self.counted = True
        self.since = time.monotonic()
        self.inner.connection_made(_PeerTransport(transport, self))

    def _too_slow(self) -> None:
        self.timer = None
        self.site.closed["header_timeout"] += 1
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.counted:
            return
        heads = self.framing.heads
        self.framing.feed(data)
        self.in_requests += self.framing.heads - heads
        self._deadline()
        self.inner.data_received(data)

    def _deadline(self) -> None:
        """The header deadline runs while a head is arriving (from its first byte), and only
        then: it starts with the head, so a head cannot restart it by arriving in pieces."""
        if self.framing.in_head:
            if self.timer is None:
                self.timer = asyncio.get_running_loop().call_later(self.site.header_timeout_s,
                                                                   self._too_slow)
        elif self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def request_done(self) -> None:
        self.in_requests = max(0, self.in_requests - 1)
        if self.evictable:
            self.since = time.monotonic()

    def eof_received(self):
        return self.inner.eof_received() if self.counted else None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.counted:
            self.counted = False
            self.site.release(self)
            self.inner.connection_lost(exc)


@web.middleware
async def _request_slots(request: web.Request, handler):
    """Tells the connection guard when a request's handler is done (the connection is between
    requests again, so its slot may be taken under pressure)."""
    conn = getattr(request.transport, "r9k_conn", None)
    try:
        return await handler(request)
    finally:
        if conn is not None:
            conn.request_done()


class _GuardedSite(web.TCPSite):
    def __init__(self, runner: web.AppRunner, host: str, port: int, *, max_connections: int,
                 max_per_peer: int, header_timeout_s: float) -> None:
        super().__init__(runner, host, port)
        if max_connections < 1 or max_per_peer < 1 or not header_timeout_s > 0:
            raise ValueError(f"entry connection limits {max_connections} / {max_per_peer} per peer, "
                             f"header timeout {header_timeout_s!r}: expected >= 1, >= 1 and > 0 s")
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self.header_timeout_s = header_timeout_s
        self.peers: dict[str, set[_GuardedConnection]] = {}
        self.open_connections = 0
        self.closed = dict.fromkeys(CLOSE_REASONS, 0)

    def admit(self, conn: _GuardedConnection) -> bool:
        """Whether a new connection gets a slot, taking one from an evictable connection of the
        address holding the most when every slot is taken."""
        mine = self.peers.get(conn.peer, set())
        if len(mine) >= self.max_per_peer:
            self.closed["refused_peer"] += 1
            return False
        if self.open_connections >= self.max_connections:
            victim = self._victim()
            if victim is None:
                self.closed["refused_full"] += 1
                return False
            self.closed["evicted"] += 1
            self.release(victim)   # its slot is the new one's now, whenever its close completes
            victim.close()
        self.peers.setdefault(conn.peer, set()).add(conn)
        self.open_connections += 1
        return True

    def _victim(self) -> "_GuardedConnection | None":
        for _, conns in sorted(self.peers.items(), key=lambda kv: -len(kv[1])):
            idle = [c for c in conns if c.evictable]
            if idle:
                return min(idle, key=lambda c: c.since)
        return None

    def release(self, conn: _GuardedConnection) -> None:
        conns = self.peers.get(conn.peer)
        if conns is None or conn not in conns:
            return  # released already (evicted)
        conns.discard(conn)
        if not conns:
            del self.peers[conn.peer]
        self.open_connections -= 1

    @property
    def refused(self) -> int:
        return self.closed["refused_peer"] + self.closed["refused_full"]

    @property
    def timed_out(self) -> int:
        return self.closed["header_timeout"]

    async def start(self) -> None:
        await web.BaseSite.start(self)
        factory = self._runner.server
        assert factory is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _GuardedConnection(factory(), self), self._host, self._port,
            reuse_address=True, backlog=self._backlog)


def entry_limits(spec) -> dict[str, Any]:
    """serve()'s connection limits from the fleet file's `entry` section."""
    return {"max_connections": spec.max_connections, "max_per_peer": spec.max_connections_per_peer,
            "header_timeout_s": spec.header_timeout_s}


async def serve(entry: EntryPoint, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
                max_per_peer: int = MAX_CONNECTIONS_PER_PEER,
                header_timeout_s: float = HEADER_TIMEOUT_S) -> web.AppRunner:
    runner = web.AppRunner(entry.app, access_log=None, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    site = _GuardedSite(runner, host, port, max_connections=max_connections,
                        max_per_peer=max_per_peer, header_timeout_s=header_timeout_s)
    entry.site = site
    await site.start()
    return runner
