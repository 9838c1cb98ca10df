"""`r9k ops sweep`: the power cap chosen by measurement. Against a running replica on one card,
step the card's cap through values it declares valid, hold a fixed closed-loop load at each
(the bench client, a set concurrency), and record tokens per second, draw and joules per token;
then put the configured cap back, also on a failure or a signal, so nothing is left changed.

It refuses (exit 2, nothing changed) a step outside the card's `power1_cap_min/max`, a card
without a declared range, and a card whose fleet replica serves traffic (unless `--drain`,
which drains that replica through the fleet first), or a `--replica` that is a fleet replica.
Caps go through the ops path (`r9k.ops.power.apply_power`: LACT round trip or sysfs, read back);
energy comes from the card's power readings (`r9k.ops.energy`); tokens from the replica's
`vllm:generation_tokens_total` when it has one, else from the completions the client counted.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from r9k.core.fleet_status import FleetStatus
from r9k.core.http_client import HttpUnreachable, http_get, http_request
from r9k.ops import sysfs
from r9k.ops.config import OpsConfig, PowerSettings
from r9k.ops.energy import EnergyMeter
from r9k.ops.power import apply_power
from r9k.core.vllm_metrics import parse_vllm_metrics

SERVING_STATES = ("loading", "ready", "draining")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class SweepRefused(ValueError):
    """Bad input or an unsafe target: nothing was changed."""


class SweepInterrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class SweepStep:
    cap_watts: int
    cap_read_watts: float | None = None
    seconds: float = 0.0
    output_tokens: float = 0.0
    token_source: str = ""
    tokens_per_s: float | None = None
    joules: float | None = None
    watts: float | None = None
    joules_per_token: float | None = None
    gap_seconds: float = 0.0
    requests_ok: int = 0
    requests_failed: int = 0


@dataclass
class SweepResult:
    bdf: str
    host: str
    replica: str
    model: str
    concurrency: int
    hold_s: float
    warmup_s: float
    cap_range_watts: tuple[float, float]
    cap_file_before: str
    restore_cap_watts: int
    steps: list[SweepStep] = field(default_factory=list)
    cap_file_after: str | None = None
    restored: bool = False
    stopped: str | None = None     # why the sweep ended early (a failure or a signal)
    fleet: str | None = None       # what the fleet check found
    date: str = ""
    commit: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["cap_range_watts"] = list(self.cap_range_watts)
        best = self.best()
        data["most_efficient_cap_watts"] = best.cap_watts if best else None
        return data

    def best(self) -> SweepStep | None:
        measured = [s for s in self.steps if s.joules_per_token is not None]
        return min(measured, key=lambda s: s.joules_per_token) if measured else None


def parse_caps(text: str) -> list[int]:
    caps = []
    for word in text.split(","):
        word = word.strip()
        if not word.isdigit() or int(word) <= 0:
            raise SweepRefused(f"--caps {text!r}: {word!r} is not a whole number of watts; expected "
                               "e.g. 210,240,270,300")
        caps.append(int(word))
    if len(set(caps)) != len(caps):
        raise SweepRefused(f"--caps {text!r}: a cap is given twice")
    return caps


def sweep_card(host_root: str, bdf: str, caps: list[int]) -> sysfs.Card:
    """The card to sweep, with every step inside its declared range; SweepRefused otherwise."""
    card = next((c for c in sysfs.discover_cards(host_root, enrich=False) if c.bdf == bdf), None)
    if card is None or card.hwmon_dir is None:
        raise SweepRefused(f"--card {bdf}: not an amdgpu card with hwmon on this host")
    check_caps(card, caps)
    return card


def check_caps(card: sysfs.Card, caps: list[int]) -> None:
    """Every step inside the card's declared range, or SweepRefused naming the first that is not."""
    lo, hi = card.cap_min_watts, card.cap_max_watts
    if lo is None or hi is None:
        raise SweepRefused(f"{card.bdf}: the card declares no power cap range (power1_cap_min/max "
                           "missing); no cap is written to it")
    for cap in caps:
        if not lo <= cap <= hi:
            raise SweepRefused(f"--caps: {cap} W is outside {card.bdf}'s declared range "
                               f"{lo:g}-{hi:g} W; nothing was changed")


def _fleet_status(fleet_url: str) -> FleetStatus:
    return FleetStatus.model_validate(json.loads(http_get(fleet_url.rstrip("/") + "/fleet/status",
                                                          timeout_s=5)))


def check_fleet(fleet_url: str | None, explicit: bool, host: str, bdf: str, replica_url: str,
                drain: bool, api_key: str | None, drain_timeout_s: float = 300.0) -> str:
    """What the fleet says about this card; SweepRefused when its replica serves traffic (and
    ``drain`` is off) or ``replica_url`` is a fleet replica. With ``drain`` the card is drained
    through the fleet and the replica waited for."""
    if fleet_url is None:
        return "no fleet checked"
    try:
        status = _fleet_status(fleet_url)
    except HttpUnreachable as exc:
        if explicit:
            raise SweepRefused(f"--fleet {fleet_url}: does not answer ({exc}); expected the fleet's "
                               "entry point, or leave --fleet out where no fleet runs") from None
        return f"no fleet answers at {fleet_url}"
    except ValueError as exc:
        raise SweepRefused(f"--fleet {fleet_url}: /fleet/status is not a fleet status ({exc})") from None
    wanted = replica_url.rstrip("/")
    for r in status.replicas:
        if r.url and r.url.rstrip("/") == wanted and r.state in SERVING_STATES:
            raise SweepRefused(f"--replica {replica_url} is fleet replica {r.name} ({r.state}): a sweep "
                               "changes the latency of fleet traffic; start a replica of your own on "
                               "the card (after `r9k fleet drain --card`)")

    def serving() -> list[str]:
        names = {c.replica for c in status.cards if c.bdf == bdf and (c.host or host) == host and c.replica}
        return [r.name for r in status.replicas if r.name in names and r.state in SERVING_STATES]

    busy = serving()
    if not busy:
        return f"fleet at {fleet_url}: no replica on {host}/{bdf}"
    if not drain:
        raise SweepRefused(f"{host}/{bdf} runs fleet replica {', '.join(busy)}: drain it first "
                           f"(r9k fleet drain --card {bdf} --host {host}) or pass --drain")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = http_request(fleet_url.rstrip("/") + "/fleet/drain", method="POST",
                        json_body={"card": bdf, "host": host, "reason": "power sweep"},
                        headers=headers, timeout_s=30)
    if resp.status != 200:
        raise SweepRefused(f"--drain: the fleet refused to drain {host}/{bdf}: HTTP {resp.status} "
                           f"{resp.text[:200]}")
    deadline = time.monotonic() + drain_timeout_s
    while time.monotonic() < deadline:
        status = _fleet_status(fleet_url)
        busy = serving()
        if not busy:
            return f"fleet at {fleet_url}: drained {host}/{bdf} (stays out until `r9k fleet undrain`)"
        time.sleep(1.0)
    raise SweepRefused(f"--drain: {', '.join(busy)} still serving after {drain_timeout_s:g} s")


def _cap_file(card: sysfs.Card) -> str:
    assert card.hwmon_dir is not None
    return (card.hwmon_dir / "power1_cap").read_text().strip()


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _tokens_total(base: str) -> float | None:
    from r9k.bench.compare import read_metrics_text

    text = read_metrics_text(base)
    try:
        return parse_vllm_metrics(text).generation_tokens if text is not None else None
    except ValueError:
        return None


class _Signals:
    """SIGTERM, SIGINT and SIGHUP stop the sweep so that the `finally` restoring the cap always runs;
    the previous handlers come back after.

    Outside the event loop the handler raises SweepInterrupted. While a hold runs it must not: an
    exception raised from a handler lands in whatever callback the loop is running, and asyncio
    catches and logs those (a transport's read callback logs "Fatal read error" and goes on), so the
    signal would be lost. There it cancels the hold's task instead, and `run` raises
    SweepInterrupted once the hold has ended."""

    def __enter__(self) -> "_Signals":
        self.received: int | None = None
        self.task: asyncio.Task | None = None     # the hold running now, if any

        def on_signal(signum, _frame):
            self.received = signum
            task = self.task
            if task is not None and not task.done():
                try:
                    task.get_loop().call_soon_threadsafe(task.cancel)
                    return
                except RuntimeError:   # the loop closed under us: raise as outside it
                    pass
            raise SweepInterrupted(signum)
        self.previous = {s: signal.signal(s, on_signal) for s in SIGNALS}
        return self

    def run(self, coro) -> None:
        """asyncio.run(coro), with a signal during it raised as SweepInterrupted once it has ended."""
        async def tracked():
            self.task = asyncio.current_task()
            try:
                if self.received is not None:   # a signal came while the loop was starting
                    coro.close()
                    return None
                return await coro
            finally:
                self.task = None
        try:
            asyncio.run(tracked())
        except asyncio.CancelledError:
            if self.received is None:
                raise
        if self.received is not None:
            raise SweepInterrupted(self.received)

    def __exit__(self, *exc) -> None:
        self.task = None
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def run_sweep(*, config: OpsConfig, host_root: str, bdf: str, caps: list[int], base: str,
              model: str, concurrency: int, hold_s: float, warmup_s: float, prompt_chars: int,
              output_tokens: int, sample_hz: float = 5.0, backend: str | None = None,
              host: str | None = None, fleet_note: str | None = None,
              progress: Callable[[str], None] = lambda _line: None) -> SweepResult:
    """The sweep itself (the checks that refuse are done: caps in range, fleet clear)."""
    from r9k.bench.client import drive, new_session
    from r9k.bench.soak import prompt_of_length

    card = sweep_card(host_root, bdf, caps)
    wanted = config.wanted(bdf)
    restore_cap = wanted.power_cap_watts
    if restore_cap is None:   # no configured cap: the one the card had before
        restore_cap = int(round(card.cap_watts)) if card.cap_watts is not None else None
    if restore_cap is None:
        raise SweepRefused(f"{bdf}: neither the ops config nor the card says which cap to restore")
    result = SweepResult(bdf=bdf, host=host or socket.gethostname(), replica=base, model=model,
                         concurrency=concurrency, hold_s=hold_s, warmup_s=warmup_s,
                         cap_range_watts=(card.cap_min_watts, card.cap_max_watts),
                         cap_file_before=_cap_file(card), restore_cap_watts=restore_cap,
                         fleet=fleet_note, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                         commit=_commit())

    def config_with(cap: int) -> OpsConfig:
        cards = dict(config.cards)
        cards[bdf] = PowerSettings(power_cap_watts=cap, voltage_offset_mv=wanted.voltage_offset_mv)
        return config.model_copy(update={"cards": cards})

    def set_cap(cap: int) -> float | None:
        report = apply_power(config_with(cap), host_root=host_root, backend_override=backend,
                             only={bdf}, wait_s=10.0)
        status = next((c for c in report.cards if c.bdf == bdf), None)
        if status is None or not status.ok:
            raise RuntimeError(f"cap {cap} W not applied to {bdf}: "
                               f"{'; '.join(status.drift) if status else 'card not managed'}")
        return status.actual_cap_watts

    meter = EnergyMeter(host_root, sample_hz=sample_hz, host=result.host).start()
    rng = random.Random(0)
    prompts = [prompt_of_length(rng, i, prompt_chars) for i in range(4096)]

    def payload(i: int) -> tuple[dict, dict]:
        return ({"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": output_tokens,
                 "temperature": 0, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}, {})

    async def hold(step: SweepStep) -> None:
        results: list = []
        async with new_session(concurrency) as session:
            load = asyncio.ensure_future(drive(payload, session, base, concurrency=concurrency,
                                               duration_s=warmup_s + hold_s + 3600, timeout_s=600,
                                               results=results))
            try:
                await asyncio.sleep(warmup_s)
                if load.done():
                    raise RuntimeError(f"the load stopped during warm-up: {load.result()[1]}")
                tokens0 = await asyncio.to_thread(_tokens_total, base)
                await asyncio.to_thread(meter.sample_once)
                j0, g0, _ = meter.joules([bdf])
                n0, t0 = len(results), time.monotonic()
                await asyncio.sleep(hold_s)
                tokens1 = await asyncio.to_thread(_tokens_total, base)
                await asyncio.to_thread(meter.sample_once)
                j1, g1, sources = meter.joules([bdf])
                step.seconds = time.monotonic() - t0
            finally:
                load.cancel()
                await asyncio.gather(load, return_exceptions=True)
        window = results[n0:]
        step.requests_ok = sum(1 for r in window if r.status == "ok")
        step.requests_failed = sum(1 for r in window if r.status != "ok")
        if tokens0 is not None and tokens1 is not None:
            step.output_tokens, step.token_source = tokens1 - tokens0, "vllm:generation_tokens_total"
        else:
            step.output_tokens = float(sum(r.completion_tokens or 0 for r in window if r.status == "ok"))
            step.token_source = "completions counted by the client"
        step.tokens_per_s = step.output_tokens / step.seconds if step.seconds > 0 else None
        if sources:
            step.joules, step.gap_seconds = j1 - j0, g1 - g0
            step.watts = step.joules / step.seconds if step.seconds > 0 else None
            step.joules_per_token = step.joules / step.output_tokens if step.output_tokens > 0 else None

    try:
        with _Signals() as signals:
            try:
                for cap in caps:
                    step = SweepStep(cap_watts=cap)
                    step.cap_read_watts = set_cap(cap)
                    progress(f"cap {cap} W set (reads {step.cap_read_watts} W): holding "
                             f"{warmup_s:g} + {hold_s:g} s at concurrency {concurrency}")
                    signals.run(hold(step))
                    if step.requests_ok == 0 and step.output_tokens <= 0:
                        raise RuntimeError(f"no tokens at cap {cap} W "
                                           f"({step.requests_failed} requests failed)")
                    result.steps.append(step)
            except SweepInterrupted as exc:
                result.stopped = f"interrupted by {exc}"
            except Exception as exc:  # noqa: BLE001 - any failure: restore, then report it
                result.stopped = f"{type(exc).__name__}: {exc}"
            finally:
                # the cap goes back whatever happened; a second signal cannot skip it
                for s in SIGNALS:
                    signal.signal(s, signal.SIG_IGN)
                progress(f"restoring {restore_cap} W")
                try:
                    set_cap(restore_cap)
                    result.restored = True
                except Exception as exc:  # noqa: BLE001
                    result.stopped = (result.stopped or "") + f"; RESTORE FAILED: {exc}"
                fresh = sysfs.refresh(card)
                result.cap_file_after = _cap_file(fresh)
    finally:
        meter.stop()
    return result


def table(result: SweepResult) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    lines = [f"power sweep of {result.host}/{result.bdf} (range {result.cap_range_watts[0]:g}-"
             f"{result.cap_range_watts[1]:g} W), {result.model} at concurrency {result.concurrency}, "
             f"{result.hold_s:g} s per cap after {result.warmup_s:g} s warm-up",
             f"{'cap W':>6} {'reads W':>8} {'tokens/s':>9} {'draw W':>7} {'J/token':>8} "
             f"{'ok':>5} {'failed':>6} {'gap s':>6}"]
    best = result.best()
    for s in result.steps:
        lines.append(f"{s.cap_watts:>6} {f(s.cap_read_watts, '.0f'):>8} {f(s.tokens_per_s, '.1f'):>9} "
                     f"{f(s.watts, '.1f'):>7} {f(s.joules_per_token, '.3f'):>8} {s.requests_ok:>5} "
                     f"{s.requests_failed:>6} {s.gap_seconds:>6.1f}"
                     + ("  <- fewest joules per token" if best is s else ""))
    if any(s.joules is None for s in result.steps):
        lines.append("draw not measured: the card has no power1_average, power1_input or energy1_input")
    lines.append(f"power1_cap before {result.cap_file_before} uW, after {result.cap_file_after} uW: "
                 + (f"restored to {result.restore_cap_watts} W" if result.restored
                    else "NOT RESTORED"))
    if result.stopped:
        lines.append(f"stopped early: {result.stopped}")
    return "\n".join(lines)


def plot(result: SweepResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [s.cap_watts for s in result.steps]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(caps, [s.tokens_per_s or 0 for s in result.steps], "o-")
    a.set_xlabel("power cap (W)")
    a.set_ylabel("output tokens / s")
    b.plot(caps, [s.joules_per_token if s.joules_per_token is not None else float("nan")
                  for s in result.steps], "o-", color="tab:red")
    b.set_xlabel("power cap (W)")
    b.set_ylabel("joules / output token")
    fig.suptitle(f"{result.host}/{result.bdf}: {result.model}, concurrency {result.concurrency} "
                 f"({result.date}, {result.commit or 'no commit'})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(result: SweepResult, out_dir: Path) -> tuple[Path, Path | None]:
    stem = f"power-sweep_{result.bdf.replace(':', '-')}_{result.date[:10]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    png: Path | None = out_dir / f"{stem}.png"
    try:
        plot(result, png)
    except ModuleNotFoundError:
        png = None
    return json_path, png


def default_fleet_url() -> tuple[str | None, bool]:
    url = os.environ.get("R9K_FLEET_URL")
    return (url, True) if url else ("http://127.0.0.1:8000", False)
