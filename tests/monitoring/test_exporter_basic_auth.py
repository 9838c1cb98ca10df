"""The exporter's basic auth. A malformed bcrypt hash is refused at start; wrong guesses cannot
starve a real scrape (bounded concurrent checks, a header that passed skips bcrypt); an unknown
user costs a real bcrypt check of the users' cost. Also the watcher's heartbeat, exported."""
from __future__ import annotations

import base64
import threading
import urllib.error
import urllib.request

import bcrypt
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Gauge

from r9k.cli import main
from r9k.monitoring import web_config
from r9k.monitoring.web_config import BasicAuth, WebConfigError, load_web_config, serve


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(scope="module")
def hashed() -> str:
    return bcrypt.hashpw(b"scrape-secret", bcrypt.gensalt(rounds=5)).decode()


def test_a_malformed_bcrypt_hash_is_refused_at_start(tmp_path, hashed):
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{hashed[:-10]}'\n")  # cut short
    with pytest.raises(WebConfigError, match=r"basic_auth_users.prometheus: not a valid bcrypt hash"):
        load_web_config(web)
    result = CliRunner().invoke(main, ["exporter", "--once", "--no-cards", "--web-config-file", str(web)])
    assert result.exit_code == 2 and "not a valid bcrypt hash" in result.output
    web.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    assert load_web_config(web)[0].basic_auth_users == {"prometheus": hashed}


def test_unknown_users_cost_a_real_check_of_the_same_cost(hashed, monkeypatch):
    auth = BasicAuth({"prometheus": hashed})
    used = []
    real = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda pw, h: used.append(h) or real(pw, h))
    assert auth.check(_basic("nobody", "x")) is False
    assert auth.check(_basic("prometheus", "wrong")) is False
    dummy, known = used
    assert known == hashed.encode() and dummy != known
    assert dummy.split(b"$")[2] == known.split(b"$")[2] == b"05"  # same cost: same time
    assert real(b"anything", dummy) is False  # a valid hash, not one that fails fast


def test_guesses_cannot_starve_a_scrape(hashed, monkeypatch):
    """Every check slot held by slow guesses: a header that passed before is served at once;
    another guess from the same address gets 429 at once, not a place in the queue."""
    monkeypatch.setattr(web_config, "AUTH_WAIT_S", 0.05)
    registry = CollectorRegistry()
    Gauge("r9k_test_up", "test", registry=registry).set(1)
    server, _ = serve(registry, 0, "127.0.0.1", (web_config.WebConfig(basic_auth_users={"prometheus": hashed}),
                                                 None))
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"

    def get(auth: str) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": auth}),
                                        timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    gate, entered = threading.Event(), threading.Semaphore(0)
    real = bcrypt.checkpw

    def slow(pw, h):
        if pw == b"guess":
            entered.release()
            gate.wait(5)
        return real(pw, h)

    try:
        assert get(_basic("prometheus", "scrape-secret")) == 200
        monkeypatch.setattr(bcrypt, "checkpw", slow)
        guessers = [threading.Thread(target=get, args=(_basic("prometheus", "guess"),))
                    for _ in range(web_config.AUTH_WORKERS)]
        for t in guessers:
            t.start()
        for _ in guessers:
            assert entered.acquire(timeout=5)  # every slot is held by a guess now
        assert get(_basic("prometheus", "scrape-secret")) == 200  # remembered: no bcrypt
        assert get(_basic("prometheus", "another")) == 429
        gate.set()
        for t in guessers:
            t.join(5)
        assert get(_basic("prometheus", "wrong")) == 401
    finally:
        gate.set()
        server.shutdown()
        server.server_close()


def test_the_watchers_heartbeat_is_exported(tmp_path):
    """The watcher touches watch-heartbeat at every poll; the exporter exports
    its time (alert OpsWatcherStale, promtool cases in r9k.rules.test.yml); absent when the
    watcher never ran there."""
    import os

    from prometheus_client.parser import text_string_to_metric_families

    from doubles.monitored_host import build_monitored_host
    from r9k.monitoring.exporter import build_collector, build_registry, render
    from r9k.ops.state import HEARTBEAT_FILE

    root, state, config = build_monitored_host(tmp_path)  # the real watcher polled a log there

    def exported():
        text = render(build_registry(build_collector(root, state, config)))
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    beat = (state / HEARTBEAT_FILE).stat().st_mtime
    assert exported()["r9k_ops_watch_heartbeat_timestamp_seconds"] == beat
    os.utime(state / HEARTBEAT_FILE, (beat - 600, beat - 600))  # a watcher that stopped 10 min ago
    assert exported()["r9k_ops_watch_heartbeat_timestamp_seconds"] == beat - 600
    (state / HEARTBEAT_FILE).unlink()
    assert "r9k_ops_watch_heartbeat_timestamp_seconds" not in exported()
