"""The exporter against hostile and careless input, over real HTTP on 127.0.0.1: basic-auth
headers of any shape, floods of wrong passwords, user names probed by timing, replicas that
trickle their /metrics or report NaN, MES logs that cannot be read or block, bad --replica and
--listen values."""
from __future__ import annotations

import base64
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import bcrypt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge

from r9k.monitoring import web_config
from r9k.monitoring.web_config import BasicAuth, WebConfig, serve

USER, PASSWORD = "prometheus", "scrape-secret"


def _basic(user: str | bytes, password: str | bytes, scheme: str = "Basic") -> bytes:
    raw = (user if isinstance(user, bytes) else user.encode()) + b":" + (
        password if isinstance(password, bytes) else password.encode())
    return scheme.encode() + b" " + base64.b64encode(raw)


def _raw_get(port: int, authorization: bytes | None, source: str = "127.0.0.1", timeout_s: float = 15.0) -> int:
    """The status of one GET /metrics sent byte for byte (any header bytes, from any loopback
    source address); 0 when the connection closed without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s, source_address=(source, 0)) as conn:
        request = b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n"
        if authorization is not None:
            request += b"Authorization: " + authorization + b"\r\n"
        conn.sendall(request + b"\r\n")
        head = b""
        while b"\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                break
            head += chunk
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", head)
    return int(match.group(1)) if match else 0


@contextmanager
def _auth_server(users: dict[str, str]):
    registry = CollectorRegistry()
    Gauge("r9k_test_up", "test", registry=registry).set(1)
    server, _ = serve(registry, 0, "127.0.0.1", (WebConfig(basic_auth_users=users), None))
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def cheap_hash() -> str:
    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def auth_port(cheap_hash):
    with _auth_server({USER: cheap_hash}) as port:
        yield port


# -- basic auth: malformed headers -------------------------------------------------------------

def test_a_password_over_72_bytes_is_401_not_500(auth_port, capfd):
    for password in (b"x" * 73, PASSWORD.encode() + b"y" * 100, b"\xc3\xa9" * 40):
        assert _raw_get(auth_port, _basic(USER, password)) == 401, password
    assert _raw_get(auth_port, _basic(USER, PASSWORD)) == 200
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("header", [
    b"Basic !!!not-base64!!!", b"Basic " + base64.b64encode(b"no-colon-here"),
    b"Basic " + base64.b64encode(b"\xff\xfe:" + PASSWORD.encode()),   # user not UTF-8
    b"Basic \xe9\xe9\xe9",                                            # header bytes not ASCII
    b"Basic " + base64.b64encode(b"prometheus:" + b"a" * 20_000),    # 27 KB header
    b"Basic", b"", b"Bearer abc", b"Basic " + base64.b64encode(b":"),
    b"Basic " + base64.b64encode(USER.encode() + b":" + PASSWORD.encode() + b"\x00"),
], ids=["bad-base64", "no-colon", "user-not-utf8", "non-ascii", "huge", "scheme-only", "empty",
        "bearer", "colon-only", "nul-suffix"])
def test_a_malformed_authorization_header_is_401_never_500(auth_port, header, capfd):
    assert _raw_get(auth_port, header) == 401
    assert "Traceback" not in capfd.readouterr().err


def test_a_header_line_over_http_servers_limit_is_refused_with_4xx_not_500(auth_port, capfd):
    # Past 64 KiB the standard library's HTTP parser answers 431 before the request reaches auth.
    assert _raw_get(auth_port, b"Basic " + b"A" * 70_000) in (401, 431)
    assert "Traceback" not in capfd.readouterr().err


def _independently_right(value: bytes) -> bool:
    parts = value.split()
    if len(parts) != 2 or parts[0].lower() != b"basic":
        return False
    try:
        return base64.b64decode(parts[1], validate=True) == f"{USER}:{PASSWORD}".encode()
    except ValueError:
        return False


_header_bytes = st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_headers = st.one_of(_header_bytes, _header_bytes.map(lambda b: b"Basic " + b))
_credentials = st.tuples(
    st.sampled_from(["Basic", "basic", "BASIC", "Bearer", "Digest", "Basic:"]),
    st.one_of(st.just(USER.encode()), st.binary(max_size=40)),
    st.one_of(st.just(PASSWORD.encode()), st.binary(max_size=40), st.binary(min_size=60, max_size=200),
              st.just(PASSWORD.encode() + b"x"), st.just(PASSWORD.encode()[:-1])))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_headers, _credentials))
def test_any_authorization_header_is_200_only_for_the_right_credentials_else_401(auth_port, example):
    if isinstance(example, tuple):
        scheme, user, password = example
        header = _basic(user, password, scheme)
        right = scheme.lower() == "basic" and user == USER.encode() and password == PASSWORD.encode()
    else:
        header, right = example, None
    status = _raw_get(auth_port, header)
    assert status in (200, 401), (header, status)
    assert (status == 200) == (right if right is not None else _independently_right(header)), (header, status)


# -- basic auth: what is remembered, what a name costs -----------------------------------------

def test_a_wrong_password_is_never_remembered_as_a_pass(auth_port):
    wrong = _basic(USER, "not-the-secret")
    assert [_raw_get(auth_port, wrong) for _ in range(4)] == [401] * 4
    assert _raw_get(auth_port, _basic(USER, PASSWORD)) == 200
    assert [_raw_get(auth_port, wrong) for _ in range(2)] == [401] * 2
    auth = BasicAuth({USER: bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()})
    assert [auth.check(wrong.decode()) for _ in range(3)] == [False] * 3


def test_unknown_and_cheaper_users_cost_the_same_bcrypt_work(monkeypatch):
    """An unknown name, a user whose hash is cheaper and one whose hash is the dearest cost the
    same: 2^max_cost rounds each (counted), and about the same time (measured)."""
    cheap = bcrypt.hashpw(b"cheap-secret", bcrypt.gensalt(rounds=4)).decode()
    dear = bcrypt.hashpw(b"dear-secret", bcrypt.gensalt(rounds=10)).decode()
    auth = BasicAuth({"cheap": cheap, "dear": dear})
    cases = {"unknown": ("nobody", b"x"), "cheap wrong": ("cheap", b"x"), "cheap right": ("cheap", b"cheap-secret"),
             "dear wrong": ("dear", b"x"), "too long": ("cheap", b"y" * 100)}
    real = bcrypt.checkpw
    rounds: list[int] = []
    monkeypatch.setattr(bcrypt, "checkpw", lambda pw, h: rounds.append(2 ** int(h.split(b"$")[2])) or real(pw, h))
    for name, (user, password) in cases.items():
        rounds.clear()
        auth.verify(user, password)
        assert sum(rounds) == 2 ** 10, (name, rounds)
    monkeypatch.setattr(bcrypt, "checkpw", real)
    medians = {}
    for name, (user, password) in cases.items():
        times = []
        for _ in range(5):
            started = time.perf_counter()
            auth.verify(user, password)
            times.append(time.perf_counter() - started)
        medians[name] = statistics.median(times)
    reference = medians["dear wrong"]
    assert all(0.5 < t / reference < 2.0 for t in medians.values()), medians  # was 1/64 for "cheap"
    assert auth.verify("cheap", b"cheap-secret") and not auth.verify("cheap", b"x")


# -- basic auth: a flood of wrong passwords ----------------------------------------------------

def _exporter_with_auth(tmp_path: Path, users: dict[str, str]) -> tuple[subprocess.Popen, int]:
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users:\n" + "".join(f"  {u}: '{h}'\n" for u, h in users.items()))
    proc = subprocess.Popen([sys.executable, "-c", "from r9k.cli import main; main()", "exporter", "--port", "0",
                             "--no-cards", "--web-config-file", str(web)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r":(\d+)/metrics", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(match.group(1))


def test_a_flood_of_wrong_passwords_does_not_starve_a_scraper_not_yet_remembered(tmp_path):
    """100 clients, each on an address of its own, send wrong passwords as fast as they are
    answered; once each has failed, a scraper with a header the exporter has not seen yet (a user
    of its own each time) gets 200 every time within a few seconds. Taken in turn with the
    flooders it would wait for about 50 checks (about 6 s at cost 11); before, every scrape got
    503 after 0.5 s."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=11)).decode()
    users = {USER: hashed} | {f"scraper-{i}": hashed for i in range(15)}
    proc, port = _exporter_with_auth(tmp_path, users)
    stop = threading.Event()
    lock = threading.Lock()
    answers: dict[int, int] = {}
    failed_once: set[int] = set()

    def flood(index: int) -> None:
        source = f"127.0.1.{index + 1}"
        while not stop.is_set():
            try:
                status = _raw_get(port, _basic(USER, f"guess-{index}"), source=source, timeout_s=30)
            except OSError:
                status = -1
            with lock:
                answers[status] = answers.get(status, 0) + 1
                if status == 401:
                    failed_once.add(index)

    flooders = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(100)]
    scrapes: list[tuple[int, float]] = []
    try:
        for t in flooders:
            t.start()
        deadline = time.monotonic() + 60
        while len(failed_once) < 100 and time.monotonic() < deadline:
            time.sleep(0.2)
        for i in range(15):
            started = time.monotonic()
            status = _raw_get(port, _basic(f"scraper-{i}", PASSWORD), timeout_s=30)
            scrapes.append((status, round(time.monotonic() - started, 2)))
    finally:
        stop.set()
        proc.terminate()  # first: flooders waiting for an answer see the connection close
        _, err = proc.communicate(timeout=10)
        for t in flooders:
            t.join(30)
    assert len(failed_once) == 100, answers  # the flood really ran and was checked
    assert [s for s, _ in scrapes] == [200] * 15, (scrapes, answers)
    assert max(t for _, t in scrapes) < 3.0, scrapes
    assert "Traceback" not in err
