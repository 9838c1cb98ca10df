"""Every request through the entry point ends as one counted outcome (served, rejected, errored,
broken), a dropped request is retried once on another replica, and a stream whose replica dies
mid-answer ends with a well-formed error event: real HTTP, fake replicas, no engine."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from r9k.deploy.entry import EntryPoint, Route
from r9k.devtools.local_server import free_port
from r9k.core.http_client import http_request

from doubles.entry_fleet import LoopServers, Table


def replica_app(name: str, mode: str) -> web.Application:
    app = web.Application()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if mode == "teapot":
            return web.json_response({"error": "no"}, status=418)
        if mode == "broken":  # two events, then the replica dies
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(2):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                await asyncio.sleep(0.05)
            request.transport.close()
            return resp
        if mode == "slow-stream":  # a long stream, one event every 50 ms
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(int(body.get("events", 40))):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                await asyncio.sleep(0.05)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if mode == "cut-body":  # a plain answer's headers and half its body, then death
            resp = web.StreamResponse(headers={"Content-Type": "application/json",
                                               "Content-Length": "400"})
            await resp.prepare(request)
            await resp.write(b'{"replica": "cut-body", "choices": [')
            await asyncio.sleep(0.05)
            request.transport.close()
            return resp
        return web.json_response({"replica": name, "model": body["model"]})

    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture
def fleet():
    servers = LoopServers()
    routes = [Route(name, "m", servers.app(replica_app(name, mode)))
              for name, mode in (("good", "ok"), ("teapot", "teapot"), ("broken", "broken"),
                                 ("cut-body", "cut-body"), ("slow", "slow-stream"))]
    for name in ("dead-1", "dead-2"):
        routes.append(Route(name, "m", f"http://127.0.0.1:{free_port()}", outstanding=-9))
    table = Table(routes)
    entry = EntryPoint(table, routing="least-outstanding")
    yield type("F", (), {"url": servers.entry(entry), "table": table, "entry": entry})
    servers.close()


def post(f, body):
    return http_request(f.url + "/v1/completions", method="POST", json_body=body, timeout_s=30)


def outcomes(f) -> dict[str, float]:
    text = http_request(f.url + "/metrics", timeout_s=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("r9k_entry_requests_total{"):
            out[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("r9k_entry_retries_total "):
            out["retries"] = float(line.rsplit(" ", 1)[1])
    return out


def test_each_request_ends_as_one_counted_outcome(fleet):
    fleet.table.ready = {"good"}
    assert post(fleet, {"model": "m"}).status == 200
    assert post(fleet, {"model": "nope"}).status == 404          # rejected by the entry point
    assert post(fleet, {"no": "model"}).status == 404
    fleet.table.ready = {"teapot"}
    assert post(fleet, {"model": "m"}).status == 418             # the replica's 4xx: rejected
    fleet.table.ready = set()
    assert post(fleet, {"model": "m"}).status == 503             # errored, names the states
    got = outcomes(fleet)
    assert got == {"served": 1, "rejected": 3, "errored": 1, "broken": 0, "cancelled": 0,
                   "retries": 0}, got


def test_a_dropped_request_is_retried_once_then_502(fleet):
    from r9k.deploy.entry import REFUSED_SKIP_S

    routes = {r.name: r for r in fleet.table.all}
    fleet.table.ready = {"dead-1", "good"}  # dead-1 has the fewest outstanding: tried first
    resp = post(fleet, {"model": "m"})
    assert resp.status == 200 and resp.json()["replica"] == "good"
    # dead-1 refused: skipped while another replica can take requests (no retry needed)
    assert routes["dead-1"].refused_until > 0
    resp = post(fleet, {"model": "m"})
    assert resp.status == 200 and outcomes(fleet)["retries"] == 1
    fleet.table.ready = {"dead-1", "dead-2"}  # only refusing replicas: each tried, one retry
    routes["dead-1"].refused_until -= REFUSED_SKIP_S
    resp = post(fleet, {"model": "m"})
    assert resp.status == 502
    msg = resp.json()["error"]["message"]
    assert "dead-1 (ClientConnectorError)" in msg and "dead-2 (ClientConnectorError)" in msg
    resp = post(fleet, {"model": "m"})  # both skipped but nothing else: tried anyway
    assert resp.status == 502
    got = outcomes(fleet)
    assert (got["served"], got["errored"], got["retries"]) == (2, 2, 3), got


def test_a_stream_cut_mid_answer_ends_with_an_error_event(fleet):
    fleet.table.ready = {"broken"}
    resp = post(fleet, {"model": "m", "stream": True})
    assert resp.status == 200
    events = [e[len("data: "):] for e in resp.text.split("\n\n") if e.startswith("data: ")]
    assert [json.loads(e)["i"] for e in events[:2]] == [0, 1]
    err = json.loads(events[2])["error"]
    assert err["code"] == 502 and "replica broken dropped the stream" in err["message"]
    assert events[3] == "[DONE]" and len(events) == 4
    assert outcomes(fleet)["broken"] == 1


def test_a_plain_answer_cut_mid_body_is_retried_on_another_replica(fleet):
    """Seen under a replica SIGKILL in the fleet sanity run (1 of 2,000): the replica sent a
    non-streamed answer's headers, then died. The entry point reads plain answers whole before
    answering, so the client gets the other replica's complete answer, and the retry is
    counted; the request counts once, as served."""
    fleet.table.ready = {"cut-body", "good"}
    fleet.table.all.sort(key=lambda r: r.name != "cut-body")  # least-outstanding tie: cut-body first
    resp = post(fleet, {"model": "m"})
    assert resp.status == 200 and resp.json()["replica"] == "good", resp.text
    got = outcomes(fleet)
    assert (got["served"], got["broken"], got["retries"]) == (1, 0, 1), got


def test_a_client_leaving_is_never_retried_and_counts_once(fleet):
    """Seen in the fleet soak: a client closing its connection as a stream ends made the
    server-side write raise aiohttp's ClientConnectionResetError, a ClientConnectionError, which
    the entry point took for a dropped request: it sent the request to another replica and
    counted an error the client never saw. Now a client that reads the whole stream and hangs
    up counts served; one that leaves mid-stream counts cancelled; neither is retried."""
    import socket
    import time

    fleet.table.ready = {"slow"}
    host, port = fleet.url.removeprefix("http://").split(":")

    def raw_stream(events: int, read_until: bytes) -> bytes:
        body = json.dumps({"model": "m", "stream": True, "events": events}).encode()
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while read_until not in got:
            got += s.recv(65536)
        s.close()  # hang up at once, as a client that stops reading does
        return got

    assert b"[DONE]" in raw_stream(3, b"[DONE]")       # whole answer, then gone
    assert b'"i": 2' in raw_stream(40, b'"i": 2')      # gone after 3 of 40 events
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = outcomes(fleet)
        if got["served"] + got["cancelled"] == 2:
            break
        time.sleep(0.2)
    assert (got["served"], got["cancelled"], got["errored"], got["retries"]) == (1, 1, 0, 0), got
    served = {r.name: r.served for r in fleet.table.all}
    assert served["slow"] == 2 and sum(served.values()) == 2, served
