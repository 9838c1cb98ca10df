"""The entry point under clients that try to hold it: one address holding kept-alive connections
or reopening unfinished heads must not lock other clients out; every request head (pipelined, or
after blank lines) has a deadline; a huge body does not hold the event loop. Real sockets on
loopback; clients on distinct loopback addresses (127.0.0.x) are distinct peers."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from doubles.entry_fleet import LoopServers, Table
from r9k.deploy.entry import EntryPoint, HttpFraming, JsonDepth, MAX_BODY_BYTES, MAX_JSON_DEPTH, serve
from r9k.devtools.local_server import free_port

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def _connect(port: int, source: str, timeout_s: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _answered(s: socket.socket, request: bytes = HEALTH) -> bool:
    """Whether one request on this connection got an HTTP answer (503: no replica, fine)."""
    try:
        s.sendall(request)
        return s.recv(4096).startswith(b"HTTP/1.1 ")
    except OSError:
        return False


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def entry_on():
    servers = LoopServers()
    started = []

    def start(**limits):
        entry = EntryPoint(Table([]), api_key="k")
        port = free_port()
        servers.runners.append(servers.run(serve(entry, "127.0.0.1", port, **limits)))
        started.append(entry)
        return entry, port
    yield start
    servers.close()


def _metric(entry: EntryPoint, reason: str) -> float:
    return entry.registry.get_sample_value("r9k_entry_connections_closed_total", {"reason": reason})


def test_one_address_holding_kept_alive_connections_does_not_lock_others_out(entry_on):
    """Before: the connection cap was global and first-come; one client kept 1,024 kept-alive
    connections (one /health each) and every other connection was closed at once (0 of 19
    normal requests answered)."""
    entry, port = entry_on(max_connections=16, max_per_peer=10, header_timeout_s=2.0)
    held = []
    for _ in range(30):
        s = _connect(port, "127.0.0.2")
        held.append(s)
    time.sleep(0.3)
    alive = [s for s in held if _answered(s)]
    assert len(alive) == 10  # the per-address limit: the other 20 were closed at once
    assert _metric(entry, "refused_peer") == 20
    normal = []
    for _ in range(19):
        s = _connect(port, "127.0.0.3")
        assert _answered(s)
        normal.append(s)  # kept open too: the normal client holds 6 + evicts 13 of the greedy one's
    assert all(_answered(s) for s in normal[-6:])
    assert _metric(entry, "evicted") >= 19 - 6
    for s in held + normal:
        s.close()


def test_a_full_table_gives_idle_slots_to_new_clients_from_the_biggest_holder(entry_on):
    """Even where one address may take every slot, a new client takes the slot of that address's
    oldest idle keep-alive: under pressure idle keep-alive lasts only until its slot is needed."""
    entry, port = entry_on(max_connections=8, max_per_peer=8, header_timeout_s=2.0)
    greedy = [_connect(port, "127.0.0.2") for _ in range(8)]
    assert all(_answered(s) for s in greedy)
    for _ in range(5):
        s = _connect(port, "127.0.0.3")
        assert _answered(s)
        s.close()
    time.sleep(0.2)
    assert _closed(greedy[0])  # the oldest idle one gave up its slot first
    assert _metric(entry, "evicted") >= 1
    for s in greedy:
        s.close()


def test_unfinished_heads_reopened_as_fast_as_they_close_do_not_starve_others(entry_on):
    entry, port = entry_on(max_connections=12, max_per_peer=12, header_timeout_s=1.0)
    stop = threading.Event()

    def attacker():
        conns = []
        while not stop.is_set():
            while len(conns) < 24:
                try:
                    c = _connect(port, "127.0.0.2", timeout_s=1)
                    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    c.setblocking(False)
                    conns.append(c)
                except OSError:
                    break
            time.sleep(0.05)
            for c in list(conns):
                try:
                    gone = c.recv(1) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    c.close()
                    conns.remove(c)
        for c in conns:
            c.close()

    t = threading.Thread(target=attacker, daemon=True)
    t.start()
    time.sleep(0.5)
    answered = 0
    t0 = time.monotonic()
    for _ in range(19):
        s = _connect(port, "127.0.0.3")
        answered += _answered(s)
        s.close()
    elapsed = time.monotonic() - t0
    stop.set()
    t.join(10)
    assert answered == 19, f"{answered} of 19 normal requests answered"
    assert elapsed < 20


@pytest.mark.parametrize("opening,answers", [
    (HEALTH + b"GET /health HTTP/1.1\r\nHost: x\r\n", 1),   # a pipelined second head, unfinished
    (b"\r\n\r\n\r\n", 0),                                     # blank lines and then nothing
    (b"\r\n" * 3 + b"GET /health HTTP/1.1\r\n", 0),           # a head after blank lines, unfinished
])
def test_every_request_head_has_the_deadline(entry_on, opening, answers):
    """Before: a pipelined second head, or a head after leading blank lines, was held 75-85 s
    (the keep-alive timer's, not the header deadline)."""
    _, port = entry_on(header_timeout_s=0.5)
    s = _connect(port, "127.0.0.2", timeout_s=10)
    t0 = time.monotonic()
    s.sendall(opening)
    data = b""
    while True:
        piece = s.recv(4096)
        if not piece:
            break
        data += piece
    assert time.monotonic() - t0 < 3.0
    assert data.count(b"HTTP/1.1 ") == answers
    s.close()


def test_a_head_trickled_in_blank_lines_does_not_restart_the_deadline(entry_on):
    _, port = entry_on(header_timeout_s=0.6)
    s = _connect(port, "127.0.0.2", timeout_s=10)
    t0 = time.monotonic()
    try:
        for _ in range(40):
            s.sendall(b"\r\n")
            time.sleep(0.1)
    except OSError:
        pass
    assert _closed(s)
    assert time.monotonic() - t0 < 3.0
    s.close()


def test_a_60_mib_body_does_not_hold_the_event_loop(entry_on):
    """Before: the depth scan ran over the whole body in one go: 2.3 s during which no other
    client was answered. Now the body is read and checked in pieces."""
    _, port = entry_on()
    body = json.dumps({"model": "not-served", "prompt": "words and \\n escapes " * 3_000_000}).encode()
    assert len(body) > 60 << 20
    gaps = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            s = _connect(port, "127.0.0.3", timeout_s=10)
            t0 = time.monotonic()
            assert _answered(s)
            gaps.append(time.monotonic() - t0)
            s.close()
            time.sleep(0.02)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    time.sleep(0.2)
    s = _connect(port, "127.0.0.2", timeout_s=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    reply = s.recv(4096)
    done.set()
    t.join(10)
    s.close()
    assert reply.startswith(b"HTTP/1.1 404"), reply[:200]  # parsed whole: the model is not served
    assert len(gaps) >= 5
    assert max(gaps) < 1.0, f"a /health answer took {max(gaps):.2f} s during the big body"


def test_a_body_over_the_limit_is_413_and_the_connection_closes(entry_on):
    _, port = entry_on()
    s = _connect(port, "127.0.0.2", timeout_s=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
              b"Content-Length: %d\r\n\r\n{" % ((64 << 20) + 1))
    assert s.recv(4096).startswith(b"HTTP/1.1 413")
    s.close()



def _body_of(size: int) -> bytes:
    head, tail = b'{"model": "not-served", "prompt": "', b'"}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("over", [0, 1], ids=["at-the-limit", "one-byte-over"])
def test_the_body_limit_is_64_mib_exactly_declared_or_streamed(entry_on, chunked, over):
    """A body of MAX_BODY_BYTES is read whole (the model is not served: 404); one byte more is
    413 and the connection closes, whether its length was declared or it came chunked (no
    length: counted as it arrives)."""
    assert MAX_BODY_BYTES == 64 << 20
    _, port = entry_on()
    body = _body_of(MAX_BODY_BYTES + over)
    assert len(body) == (64 << 20) + over
    s = _connect(port, "127.0.0.2", timeout_s=60)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n" \
           b"Content-Type: application/json\r\n"
    if chunked:
        piece = 1 << 20
        framed = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece])
                          for i in range(0, len(body), piece))
        request = head + b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"
    else:
        request = head + b"Content-Length: %d\r\n\r\n" % len(body) + body

    def send():
        try:
            s.sendall(request)
        except OSError:  # refused early: the server closed while the body was still coming
            pass
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    reply = s.recv(4096)
    sender.join(60)
    if over:
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        while piece := s.recv(4096):  # the rest of the answer, then the close
            reply += piece
        assert b"expected at most 67108864 bytes" in reply
    else:
        assert reply.startswith(b"HTTP/1.1 404"), reply[:200]
    s.close()

# ---- the framing the deadline follows, over any requests cut at any points ----

_header = st.tuples(st.sampled_from([b"X-A", b"Accept", b"User-Agent"]),
                    st.binary(min_size=0, max_size=20).map(
                        lambda b: b.replace(b"\r", b"").replace(b"\n", b"")))


@st.composite
def _requests(draw):
    blank = b"\r\n" * draw(st.integers(0, 3))
    headers = b"".join(k + b": " + v + b"\r\n" for k, v in draw(st.lists(_header, max_size=3)))
    kind = draw(st.sampled_from(["none", "length", "chunked"]))
    if kind == "none":
        return blank + b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    if kind == "length":
        body = draw(st.binary(max_size=300))  # may hold "\r\n\r\n" or a whole fake head
        return (blank + b"POST /v1/x HTTP/1.1\r\nHost: x\r\n" + headers
                + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    chunks = draw(st.lists(st.binary(min_size=1, max_size=80), max_size=4))
    wire = b"".join(b"%x\r\n" % len(c) + c + b"\r\n" for c in chunks) + b"0\r\n\r\n"
    return (blank + b"POST /v1/x HTTP/1.1\r\nHost: x\r\n" + headers
            + b"Transfer-Encoding: chunked\r\n\r\n" + wire)


@settings(max_examples=300, deadline=None)
@given(requests=st.lists(_requests(), min_size=1, max_size=5), data=st.data())
def test_the_framing_counts_every_head_and_ends_idle_however_the_bytes_are_cut(requests, data):
    wire = b"".join(requests)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    framing = HttpFraming()
    last = 0
    for cut in cuts + [len(wire)]:
        framing.feed(wire[last:cut])
        last = cut
    assert framing.heads == len(requests)
    assert framing.idle


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(_requests(), min_size=1, max_size=4), data=st.data())
def test_inside_a_head_the_deadline_runs_and_inside_a_body_it_does_not(requests, data):
    """Cut the stream at a point inside one request's head (blank lines included): the framer
    says in_head; cut right after a head without body: idle."""
    index = data.draw(st.integers(0, len(requests) - 1))
    before = b"".join(requests[:index])
    request = requests[index]
    head_end = request.index(b"\r\n\r\n", len(request) - len(request.lstrip(b"\r\n"))) + 4
    cut = data.draw(st.integers(1, head_end - 1))
    framing = HttpFraming()
    framing.feed(before + request[:cut])
    assert framing.in_head and framing.heads == index


@settings(max_examples=200, deadline=None)
@given(doc=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=30),
       data=st.data())
def test_json_depth_in_pieces_equals_the_documents_depth(doc, data):
    def depth(x):
        if isinstance(x, list):
            return 1 + max((depth(v) for v in x), default=0)
        if isinstance(x, dict):
            return 1 + max((depth(v) for v in x.values()), default=0)
        return 0
    text = json.dumps(doc, ensure_ascii=data.draw(st.booleans())).encode()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    scan = JsonDepth()
    last = 0
    for cut in cuts + [len(text)]:
        scan.feed(text[last:cut])
        last = cut
    assert scan.deepest == depth(doc) and scan.depth == 0 and not scan.in_string


def test_json_depth_refuses_past_the_limit_in_any_piece():
    scan = JsonDepth()
    scan.feed(b'{"a": "[[[[' + b"[" * 100 + b'", "b": ')
    with pytest.raises(ValueError, match="too deep"):
        for _ in range(MAX_JSON_DEPTH + 1):
            scan.feed(b"[")
