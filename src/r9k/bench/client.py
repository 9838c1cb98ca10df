"""OpenAI-compatible HTTP client for the benchmarks: one request -> one classified result.

Every failure becomes a `RequestResult` with an `error_kind` instead of an exception, so a run
keeps counting (and keeps its partial results) when the endpoint misbehaves; the driver decides
when the endpoint is gone (`EndpointDown`).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp

# vLLM answers an over-long prompt with 400 and this phrase (serving_engine input validation).
OVER_LENGTH_MARKERS = ("maximum context length", "max_model_len", "is too long")


OUTAGE_RETRY_S = 0.25  # a worker's pause after a transport failure while riding through an outage


class EndpointError(Exception):
    """The endpoint cannot be used (unreachable at start, or stopped answering mid-run)."""


class EndpointDown(EndpointError):
    """Too many consecutive transport failures: the endpoint is gone; the run stops early."""


def normalize_endpoint(url: str) -> str:
    """`http://host:port[/v1]` -> `http://host:port`; ValueError saying what was expected."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--endpoint {url!r}: expected http://HOST:PORT (an OpenAI-compatible "
                         f"server or the fleet entry point)")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"--endpoint {url!r}: the port is not a number in 1..65535") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


@dataclass
class RequestResult:
    index: int
    status: str                      # "ok" | "rejected" (over length, by design) | "error"
    error_kind: str | None = None    # refused | timeout | http_4xx | http_5xx | non_json | bad_shape | disconnected
    message: str | None = None
    http_status: int | None = None
    started_s: float = 0.0           # since the run started
    latency_s: float | None = None
    ttft_s: float | None = None
    prompt_chars: int = 0
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None  # prefix-cache hit, when the server reports it
    completion_tokens: int | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def transport_failure(self) -> bool:
        return self.error_kind in ("refused", "timeout", "disconnected")

    def public(self, with_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_text:
            d.pop("text")
            d.pop("token_ids")
        return {k: v for k, v in d.items() if v is not None and v != {}}


def _error_message(body: str) -> str:
    try:
        err = json.loads(body)
        if isinstance(err, dict):
            e = err.get("error", err)
            if isinstance(e, dict):
                return str(e.get("message", e))
            return str(e)
    except ValueError:
        pass
    return body[:300]


def _classify_http_error(result: RequestResult, status: int, body: str) -> RequestResult:
    msg = _error_message(body)
    result.http_status = status
    result.message = f"HTTP {status}: {msg}"
    if status == 400 and any(m in msg for m in OVER_LENGTH_MARKERS):
        result.status = "rejected"
        result.error_kind = "over_length"
    else:
        result.status = "error"
        result.error_kind = "http_5xx" if status >= 500 else "http_4xx"
    return result


async def probe(session: aiohttp.ClientSession, base: str, timeout_s: float = 10) -> dict[str, Any]:
    """GET /v1/models: the first served model's id and max_model_len; EndpointError otherwise."""
    url = base + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise EndpointError(f"{url} answered HTTP {resp.status}: {_error_message(body)}")
    except aiohttp.ClientConnectorError as exc:
        raise EndpointError(f"cannot reach {url}: {exc.os_error or exc}") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise EndpointError(f"cannot reach {url}: {type(exc).__name__} {exc}") from None
    try:
        models = json.loads(body)["data"]
        first = models[0]
        return {"model": first["id"], "max_model_len": first.get("max_model_len")}
    except (ValueError, KeyError, IndexError, TypeError):
        raise EndpointError(f"{url} did not answer an OpenAI model list (expected JSON with "
                            f"data[0].id); got: {body[:200]!r}") from None


async def complete(session: aiohttp.ClientSession, base: str, payload: dict[str, Any], *,
                   index: int, t0: float, timeout_s: float) -> RequestResult:
    """POST /v1/completions (streamed when payload['stream']); never raises for endpoint faults."""
    started = time.monotonic()
    result = RequestResult(index=index, status="error", started_s=started - t0,
                           prompt_chars=len(payload.get("prompt", "")))
    try:
        async with session.post(base + "/v1/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return _classify_http_error(result, resp.status, await resp.text())
            if payload.get("stream"):
                await _read_stream(resp, result, started)
            else:
                _read_body(await resp.text(), result)
    except aiohttp.ClientConnectorError as exc:
        result.error_kind, result.message = "refused", f"cannot connect: {exc.os_error or exc}"
    except asyncio.TimeoutError:
        result.error_kind, result.message = "timeout", f"no complete answer within {timeout_s:.0f} s"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
            aiohttp.ClientOSError) as exc:
        result.error_kind, result.message = "disconnected", f"{type(exc).__name__}: {exc}"
    except aiohttp.ClientError as exc:
        result.error_kind, result.message = "disconnected", f"{type(exc).__name__}: {exc}"
    result.latency_s = time.monotonic() - started
    return result


def _read_usage(usage: dict[str, Any], result: RequestResult) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")  # vLLM: with --enable-prompt-tokens-details
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_prompt_tokens = details["cached_tokens"]


def _read_body(body: str, result: RequestResult) -> None:
    try:
        out = json.loads(body)
    except ValueError:
        result.error_kind, result.message = "non_json", f"answer is not JSON: {body[:120]!r}"
        return
    try:
        choice = out["choices"][0]
        result.text = choice["text"]
        result.token_ids = choice.get("token_ids")
        usage = out.get("usage") or {}
        _read_usage(usage, result)
        if choice.get("logprobs"):
            result.extra["logprobs"] = choice["logprobs"]
    except (KeyError, IndexError, TypeError):
        result.error_kind, result.message = "bad_shape", f"answer lacks choices[0].text: {body[:120]!r}"
        return
    result.status, result.error_kind = "ok", None


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, started: float) -> None:
    texts: list[str] = []
    done = False
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line or line.startswith(":"):
            continue
        if not line.startswith("data:"):
            result.error_kind, result.message = "non_json", f"stream line is not SSE data: {line[:120]!r}"
            return
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            result.error_kind, result.message = "non_json", f"stream chunk is not JSON: {data[:120]!r}"
            return
        if not isinstance(chunk, dict):
            result.error_kind, result.message = "bad_shape", f"stream chunk is not an object: {data[:120]!r}"
            return
        if "error" in chunk:
            result.error_kind, result.message = "http_5xx", f"error in stream: {_error_message(data)}"
            return
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                if result.ttft_s is None:
                    result.ttft_s = time.monotonic() - started
                texts.append(choice["text"])
        usage = chunk.get("usage")
        if usage:
            _read_usage(usage, result)
    if not done:
        result.error_kind, result.message = "disconnected", "stream ended before [DONE]"
        return
    result.text = "".join(texts)
    if result.completion_tokens is None:
        result.error_kind, result.message = "bad_shape", "stream carried no usage (completion_tokens)"
        return
    result.status, result.error_kind = "ok", None


def new_session(concurrency: int) -> aiohttp.ClientSession:
    # A connection per request: reusing kept-alive ones against vLLM's server failed requests
    # ("Can not write request body", "Server disconnected") once requests queued for seconds
    # (lab/results/compare_cpu_admission.md); a loopback or LAN connect costs next to nothing.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(concurrency, 1) + 4,
                                                                force_close=True))


async def drive(make_payload: Callable[[int], tuple[dict[str, Any], dict[str, Any]]],
                session: aiohttp.ClientSession, base: str, *, concurrency: int,
                total: int | None = None, duration_s: float | None = None, timeout_s: float = 600,
                on_result: Callable[[RequestResult], None] | None = None,
                max_consecutive_transport_failures: int = 8,
                t0: float | None = None,
                results: list[RequestResult] | None = None,
                outage_tolerance_s: float | None = None) -> tuple[list[RequestResult], str | None]:
    """Closed loop: `concurrency` workers send until `total` requests or `duration_s` passed.

    Returns (results so far, why the run stopped early or None). `make_payload(i)` gives the
    request body and metadata stored on the result. The run stops early once this many
    transport failures (refused, timeout, disconnect) came in a row: the endpoint is down.
    With `outage_tolerance_s` the run rides through an outage that short (a restarting fleet
    controller): failed requests are counted, each worker waits OUTAGE_RETRY_S before its next,
    and it stops only when the failures in a row have lasted longer.
    Results are appended to `results` as they come, so an interrupted caller keeps them.
    """
    t0 = time.monotonic() if t0 is None else t0
    results = [] if results is None else results
    counter = 0
    consecutive = 0
    stop_reason: str | None = None
    stop = asyncio.Event()

    def next_index() -> int | None:
        nonlocal counter
        if stop.is_set():
            return None
        if total is not None and counter >= total:
            return None
        if duration_s is not None and time.monotonic() - t0 >= duration_s:
            return None
        counter += 1
        return counter - 1

    failing_since: float | None = None

    async def worker() -> None:
        nonlocal consecutive, stop_reason, failing_since
        while (i := next_index()) is not None:
            payload, meta = make_payload(i)
            r = await complete(session, base, payload, index=i, t0=t0, timeout_s=timeout_s)
            r.extra.update(meta)
            results.append(r)
            if r.transport_failure:
                consecutive += 1
                failing_since = failing_since or time.monotonic()
            else:
                consecutive, failing_since = 0, None
            if on_result:
                on_result(r)
            down = consecutive >= max_consecutive_transport_failures and (
                outage_tolerance_s is None or
                time.monotonic() - (failing_since or time.monotonic()) > outage_tolerance_s)
            if down and not stop.is_set():
                stop_reason = (f"endpoint {base} stopped answering: {consecutive} requests in a "
                               f"row failed ({r.error_kind}: {r.message})")
                stop.set()
            elif r.transport_failure and outage_tolerance_s is not None:
                await asyncio.sleep(OUTAGE_RETRY_S)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    results.sort(key=lambda r: r.index)
    return results, stop_reason
