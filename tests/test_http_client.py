"""The blocking HTTP client: one deadline for the whole exchange. A server that trickles its
headers or body one byte at a time cannot hold a caller (the CLI, the exporter's fleet read, the
sweep) past `timeout_s`, and leaves no thread behind; any answer is returned or HttpUnreachable."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from r9k.core.http_client import HttpUnreachable, http_get, http_request


class RawServer:
    """A TCP server on loopback that answers each connection with `script(conn)`."""

    def __init__(self, script) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.script, self.stop = script, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        try:
            conn.recv(65536)
            self.script(conn, self.stop)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _trickle_body(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while not stop.wait(0.05):
        conn.sendall(b"x")


def _trickle_close_delimited_body(conn, stop):
    """HTTP/1.0, no length: the body ends when the connection does (http.client lets go of the
    socket here, which the deadline must still reach)."""
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
    while not stop.wait(0.05):
        conn.sendall(b"#")


def _trickle_headers(conn, stop):
    for ch in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 10000:
        if stop.wait(0.05):
            return
        conn.sendall(bytes([ch]))


@pytest.mark.parametrize("script", [_trickle_body, _trickle_close_delimited_body, _trickle_headers])
def test_a_trickling_server_cannot_hold_a_caller_past_the_deadline(script):
    server = RawServer(script)
    threads = threading.active_count()
    try:
        t0 = time.monotonic()
        with pytest.raises(HttpUnreachable, match="no complete answer within 1 s"):
            http_request(server.url + "/metrics", timeout_s=1.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        server.close()
    time.sleep(0.2)
    assert threading.active_count() <= threads + 1   # the server's accept thread at most


def test_answers_of_any_status_come_back_and_the_body_is_capped():
    def answer(conn, stop):
        conn.sendall(b"HTTP/1.1 503 Busy\r\nContent-Length: 10\r\n\r\n0123456789")

    server = RawServer(answer)
    try:
        resp = http_request(server.url + "/", timeout_s=5, max_bytes=4)
        assert resp.status == 503 and resp.body == b"0123"
        with pytest.raises(HttpUnreachable, match="HTTP 503"):
            http_get(server.url + "/", timeout_s=5)
    finally:
        server.close()


@settings(max_examples=60, deadline=None)
@given(answer=st.binary(max_size=300))
def test_any_bytes_a_server_sends_are_an_answer_or_unreachable(answer):
    def script(conn, stop):
        conn.sendall(answer)

    server = RawServer(script)
    try:
        try:
            resp = http_request(server.url + "/", timeout_s=2)
        except HttpUnreachable:
            return
        assert isinstance(resp.status, int) and isinstance(resp.body, bytes)
    finally:
        server.close()
