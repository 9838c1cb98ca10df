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


# -- replicas: reads with one deadline, values that are no values ------------------------------

class _TricklingReplica:
    """A replica on 127.0.0.1 that answers /metrics with headers, then one byte every ``every_s``
    for as long as the client listens (an engine stuck mid-write, or a hostile one)."""

    def __init__(self, every_s: float = 0.05) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        stop = self.stop = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                try:
                    while not stop.wait(every_s):
                        self.wfile.write(b"#")
                        self.wfile.flush()
                except OSError:
                    return  # the reader went away: this answer is over

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _reader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("r9k-replica")]


def _scrape_no_cards(collector) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    from r9k.monitoring.exporter import build_registry, render

    text = render(build_registry(collector))
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_trickling_replica_leaves_no_reader_thread_behind():
    """Each scrape's read of a replica that trickles its /metrics ends by the read's deadline
    (1 s), not when the replica stops trickling; after five scrapes no reader thread is left."""
    from r9k.monitoring.exporter import build_collector

    from r9k.monitoring.replicas import ReplicaDescription

    assert not _reader_threads()
    with _TricklingReplica() as replica:
        collector = build_collector(cards=False, replicas=[ReplicaDescription(name="slow", url=replica.url)],
                                    timeout_s=1.0, replica_budget_s=3.0)
        took = []
        for _ in range(5):
            started = time.monotonic()
            samples = _scrape_no_cards(collector)
            took.append(time.monotonic() - started)
            assert samples[("r9k_replica_up", frozenset({("replica", "slow"), ("model", "")}))] == 0.0
        deadline = time.monotonic() + 3.0
        while _reader_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _reader_threads()
    assert left == [], left  # before: one reader per scrape, reading for as long as it trickled
    assert max(took) < 2.5, took
    assert samples[("r9k_scrape_errors_total", frozenset({("source", "replica")}))] == 5


def test_one_deadline_bounds_a_whole_read_of_a_trickling_server():
    from r9k.monitoring.replicas import get_by

    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(get_by(replica.url + "/metrics", time.monotonic() + 0.5))
        except Exception as exc:  # noqa: BLE001  (the test judges what came out)
            outcome.append(exc)

    with _TricklingReplica(every_s=0.02) as replica:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(2.0)  # a per-recv timeout would read for as long as the replica trickles
        alive = reader.is_alive()
    assert not alive and re.search("no complete answer by the deadline", str(outcome[0])), outcome


@contextmanager
def _raw_answer(answer: bytes):
    """A TCP server on 127.0.0.1 that reads a request, writes ``answer`` and closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)

    def serve_one() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)
                conn.sendall(answer)
            except OSError:
                pass

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        thread.join(5)


_http_answers = st.one_of(
    st.binary(max_size=400),
    st.builds(lambda status, headers, body: b"HTTP/1.1 " + status + b"\r\n" + headers + b"\r\n\r\n" + body,
              st.sampled_from([b"200 OK", b"404 Not Found", b"500 Oops", b"2000 x", b"abc", b""]),
              st.sampled_from([b"", b"Content-Length: 5", b"Content-Length: -1", b"Content-Length: zz",
                               b"Transfer-Encoding: chunked", b"X: " + b"y" * 70_000]),
              st.binary(max_size=200)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_http_answers)
def test_any_answer_is_a_body_or_unreachable_never_another_error(answer):
    from r9k.core.http_client import HttpUnreachable
    from r9k.monitoring.replicas import get_by

    with _raw_answer(answer) as url:
        started = time.monotonic()
        try:
            body = get_by(url + "/metrics", time.monotonic() + 3.0)
        except HttpUnreachable:
            body = None
        assert time.monotonic() - started < 4.0
    if body is not None:
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1.5, -0.1])
def test_a_kv_usage_that_is_no_ratio_is_left_out_and_counted(value):
    from doubles.monitored_host import FakeReplica
    from r9k.monitoring.exporter import build_collector
    from r9k.monitoring.replicas import ReplicaDescription

    with FakeReplica(kv_usage_ratio=value, running=2) as replica:
        collector = build_collector(cards=False, replicas=[ReplicaDescription(name="r", url=replica.url)])
        samples = _scrape_no_cards(collector)
    labels = frozenset({("replica", "r"), ("model", "tiny")})
    assert ("r9k_kv_usage_ratio", labels) not in samples, samples.get(("r9k_kv_usage_ratio", labels))
    assert samples[("r9k_replica_up", labels)] == 1.0
    assert samples[("r9k_replica_requests_running", labels)] == 2.0  # the rest of the replica is served
    assert samples[("r9k_scrape_errors_total", frozenset({("source", "replica")}))] == 1


_sample_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5))


@given(st.lists(st.tuples(st.sampled_from(["vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                                           "vllm:num_requests_waiting", "vllm:generation_tokens_total"]),
                          st.sampled_from(["0", "1", "2"]), _sample_values), max_size=8))
def test_parsed_replica_values_are_finite_and_in_range_whatever_it_reports(samples):
    import math

    from r9k.monitoring.replicas import _drop_out_of_range
    from r9k.core.vllm_metrics import parse_vllm_metrics

    def fmt(v: float) -> str:
        return "NaN" if v != v else ("+Inf" if v == math.inf else "-Inf" if v == -math.inf else repr(float(v)))

    text = "".join(f'{name}{{engine="{engine}",model_name="m"}} {fmt(value)}\n' for name, engine, value in samples)
    metrics = parse_vllm_metrics(text)
    _drop_out_of_range(metrics)
    # dropped: each non-finite sample, and each summed series whose finite samples add up past
    # the largest float (two engines reporting 9e307 running requests sum to inf)
    overflowed, totals = set(), {}
    for name, _, value in samples:
        if math.isfinite(value) and name != "vllm:kv_cache_usage_perc":
            totals[name] = totals.get(name, 0.0) + value
            if not math.isfinite(totals[name]):
                overflowed.add(name)
    assert len(metrics.invalid) == sum(1 for *_, v in samples if not math.isfinite(v)) + len(overflowed)
    for value in (metrics.kv_usage_ratio, metrics.running, metrics.waiting, metrics.generation_tokens):
        assert value is None or math.isfinite(value)
    assert metrics.kv_usage_ratio is None or 0.0 <= metrics.kv_usage_ratio <= 1.0


def test_finite_counts_that_sum_past_the_largest_float_leave_the_field_unknown():
    from r9k.core.vllm_metrics import parse_vllm_metrics

    big = 1e308
    text = (f'vllm:num_requests_running{{engine="0",model_name="m"}} {big!r}\n'
            f'vllm:num_requests_running{{engine="1",model_name="m"}} {big!r}\n'
            f'vllm:num_requests_running{{engine="2",model_name="m"}} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 5.0\n')
    metrics = parse_vllm_metrics(text)
    assert metrics.running is None and metrics.invalid == ["vllm:num_requests_running"]
    assert metrics.waiting == 7.0


# -- command line: --replica, --replica-file, --listen -----------------------------------------

def _exporter_cli(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from r9k.cli import main; main()", "exporter", *args],
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("spec, needle", [
    ("http://[::1", "Invalid IPv6 URL"), ("http://h:99999", "Port out of range"),
    ("http://h:port", "cannot be parsed"), ("http://:80", "has no host"),
    ("http://h:1,tp=2,tp=3", "tp given twice")])
def test_a_replica_url_that_cannot_be_parsed_is_one_line_and_exit_2(spec, needle):
    result = _exporter_cli("--once", "--no-cards", "--replica", spec)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stdout, result.stderr)
    assert "--replica" in lines[0] and needle in lines[0] and "expected" in lines[0], lines[0]


_spec_texts = st.one_of(
    st.text(max_size=60),
    st.builds(lambda scheme, host, port, tail: f"{scheme}://{host}{port}{tail}",
              st.sampled_from(["http", "https", "ftp", "HTTP", ""]),
              st.sampled_from(["h", "[::1]", "[::1", "::1]", "[fe80::1%eth0]", "", "a@b", "10.0.0.1", "[]"]),
              st.sampled_from(["", ":8000", ":0", ":65536", ":-1", ":x", ":", ":99999999999"]),
              st.sampled_from(["", "/", ",tp=2", ",tp=0", ",name=", ",cards=a|b", ",x", ",tp=2,tp=2",
                               ",page_mode=onepage", ",max_model_len=-1", "/metrics?a=b"])))


@settings(max_examples=300, deadline=None)
@given(_spec_texts)
def test_a_replica_spec_is_a_valid_description_or_a_replica_spec_error(spec):
    from urllib.parse import urlsplit

    from r9k.monitoring.replicas import ReplicaSpecError, parse_replica_spec

    try:
        desc = parse_replica_spec(spec)
    except ReplicaSpecError as exc:
        assert "--replica" in str(exc) and "\n" not in str(exc).strip()
        return
    parts = urlsplit(desc.url)
    assert parts.scheme in ("http", "https") and parts.hostname
    assert parts.port is None or 0 <= parts.port <= 65535
    assert desc.name and desc.tp >= 1


def test_a_replica_file_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "replicas.json"
    os.mkfifo(fifo)
    result = _exporter_cli("--once", "--no-cards", "--replica-file", str(fifo), timeout_s=20)
    assert result.returncode == 2 and "is a FIFO; expected a regular file (JSON)" in result.stderr, result


def test_an_ipv6_listen_address_is_printed_in_brackets(tmp_path):
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    for listen in ("::1", "[::1]"):
        proc = subprocess.Popen([sys.executable, "-c", "from r9k.cli import main; main()", "exporter", "--port", "0",
                                 "--no-cards", "--listen", listen], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            first = proc.stdout.readline()
        finally:
            proc.terminate()
            proc.communicate(timeout=10)
        match = re.match(r"r9k exporter: http://\[::1\]:(\d+)/metrics ", first)
        assert match, first  # before: http://::1:PORT/metrics, which no client parses


# -- MES event log: unreadable, blocked --------------------------------------------------------

CARD_A, CARD_B = "0000:03:00.0", "0000:04:00.0"


class _Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def _mes_host(base: Path):
    from doubles.ops_host import CardSpec, add_debugfs_card, build_host_tree, debugfs_dri, mes_ring, render_mes_event_log

    root = build_host_tree(base, [CardSpec(CARD_A), CardSpec(CARD_B)])
    for minor, (bdf, ring) in enumerate(((CARD_A, 3), (CARD_B, 5))):
        add_debugfs_card(root, bdf, minor, render_mes_event_log(mes_ring(ring)), "device")
    return root, lambda bdf: debugfs_dri(root) / bdf / "amdgpu_mes_event_log"


def _mes_scrape(collector, errors) -> dict[tuple[str, frozenset], float]:
    from r9k.monitoring.exporter import R9kCollector

    return _scrape_no_cards(R9kCollector({"mes_log": collector}, errors))


def _mes(samples, name: str, bdf: str) -> float | None:
    return samples.get((f"r9k_gpu_mes_log_{name}", frozenset({("bdf", bdf)})))


def test_an_unreadable_mes_log_keeps_counting_so_the_stall_alert_can_fire(tmp_path):
    from r9k.monitoring.mes_log import MesLogCollector
    from r9k.monitoring.scrape_errors import ScrapeErrors

    root, log = _mes_host(tmp_path)
    clock, errors = _Clock(), ScrapeErrors()
    collector = MesLogCollector(errors, root, "/sys/kernel/debug", clock=clock)
    s = _mes_scrape(collector, errors)
    assert _mes(s, "unchanged_seconds", CARD_A) == 0 and _mes(s, "readable", CARD_A) == 1
    good = log(CARD_A).read_bytes()
    log(CARD_A).unlink()
    log(CARD_A).mkdir()  # open() fails even for root: unreadable as EIO during a hang would be
    for elapsed in (100, 400):
        clock.now = 5000.0 + elapsed
        s = _mes_scrape(collector, errors)
        assert _mes(s, "readable", CARD_A) == 0
        assert _mes(s, "unchanged_seconds", CARD_A) == elapsed  # before: the series vanished
    assert errors.value("debugfs") == 2
    log(CARD_A).rmdir()
    log(CARD_A).write_bytes(good)  # readable again and still the same: the count went on
    clock.now = 5500.0
    assert _mes(_mes_scrape(collector, errors), "unchanged_seconds", CARD_A) == 500
    # A log unreadable from the start counts from when the card was first seen.
    fresh = MesLogCollector(errors, root, "/sys/kernel/debug", clock=clock)
    log(CARD_B).unlink()
    log(CARD_B).mkdir()
    _mes_scrape(fresh, errors)
    clock.now += 300
    s = _mes_scrape(fresh, errors)
    assert _mes(s, "readable", CARD_B) == 0 and _mes(s, "unchanged_seconds", CARD_B) == 300


def _mes_readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("r9k-mes-log")]


def test_a_blocking_mes_log_read_holds_neither_the_scrape_nor_the_other_card(tmp_path):
    """Card A's log is a FIFO nobody writes: opening it blocks, as a debugfs read can while the
    firmware is hung. A scrape ends after the read deadline with A unreadable (its count going
    on) and B read; later scrapes do not pile up readers of A; the reader ends once A answers."""
    from r9k.monitoring.mes_log import MesLogCollector
    from r9k.monitoring.scrape_errors import ScrapeErrors

    root, log = _mes_host(tmp_path)
    clock, errors = _Clock(), ScrapeErrors()
    collector = MesLogCollector(errors, root, "/sys/kernel/debug", clock=clock, read_deadline_s=0.5)
    _mes_scrape(collector, errors)
    good = log(CARD_A).read_bytes()
    log(CARD_A).unlink()
    os.mkfifo(log(CARD_A))
    results: list = []
    for _ in range(3):
        clock.now += 100
        scraper = threading.Thread(target=lambda: results.append(_mes_scrape(collector, errors)), daemon=True)
        started = time.monotonic()
        scraper.start()
        scraper.join(5.0)
        assert not scraper.is_alive(), "the scrape waited for the blocked read"  # before: for ever
        assert time.monotonic() - started < 3.0
    s = results[-1]
    assert _mes(s, "readable", CARD_A) == 0 and _mes(s, "unchanged_seconds", CARD_A) == 300
    assert _mes(s, "readable", CARD_B) == 1
    assert _mes_readers() == [f"r9k-mes-log-{CARD_A}"]  # one blocked reader, not one per scrape
    with open(log(CARD_A), "wb") as writer:  # the firmware answers
        writer.write(good)
    deadline = time.monotonic() + 5
    while _mes_readers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _mes_readers() == []
    log(CARD_A).unlink()
    log(CARD_A).write_bytes(good)
    s = _mes_scrape(collector, errors)
    assert _mes(s, "readable", CARD_A) == 1 and _mes(s, "unchanged_seconds", CARD_A) == 300


# -- a replica hung by token progress ----------------------------------------------------------

def test_a_replica_the_fleet_found_hung_is_exported_with_its_token_counter():
    from doubles.monitored_host import FakeFleet
    from doubles.monitored_host import TokenCountingReplica

    from r9k.monitoring.exporter import build_collector
    from r9k.monitoring.replicas import ReplicaDescription

    verdict = ("hung: 5 request(s) queued or running and no new token for 61 s "
               "(generation_tokens_total stuck at 12)")  # src/r9k/deploy/health.py's wording
    with TokenCountingReplica(running=2, waiting=3) as replica:
        # the typed verdict decides, never the words: r2's reason reads like a hang but no
        # verdict came with it, r4 was found hung under other words
        doc = {"replicas": [{"name": "r1", "url": replica.url, "state": "unhealthy", "reason": verdict,
                             "verdict": "hung"},
                            {"name": "r2", "url": replica.url, "state": "unhealthy",
                             "reason": "hung: looks like it, said by nobody"},
                            {"name": "r4", "url": replica.url, "state": "unhealthy",
                             "reason": "no new token", "verdict": "hung"},
                            {"name": "r5", "url": replica.url, "state": "unhealthy",
                             "reason": "no heartbeat (/health) for 20 s", "verdict": "no_heartbeat"}]}
        with FakeFleet(doc) as fleet:
            collector = build_collector(cards=False, fleet_url=fleet.url + "/status",
                                        replicas=[ReplicaDescription(name="r3", url=replica.url)])
            samples = _scrape_no_cards(collector)

    def get(name: str, replica_name: str) -> float | None:
        return samples.get((name, frozenset({("replica", replica_name), ("model", "tiny")})))

    assert [get("r9k_replica_hung", r) for r in ("r1", "r2", "r3", "r4", "r5")] == [
        1.0, 0.0, None, 1.0, 0.0]  # r3: no fleet
    assert [get("r9k_replica_generation_tokens_total", r) for r in ("r1", "r2", "r3")] == [12.0] * 3


def test_the_hang_runbooks_say_token_progress_comes_first_and_the_kernel_log_may_be_silent():
    runbooks = Path(__file__).resolve().parents[2] / "src" / "r9k" / "monitoring" / "runbooks"
    for name in ("replica-hung.md", "gpu-mes-timeout.md", "gpu-mes-log-stalled.md", "replica-down.md"):
        text = " ".join((runbooks / name).read_text().split())
        assert "token progress" in text.lower() and "primary" in text, name
        assert re.search(r"nothing (logged|in the kernel log)", text), name
