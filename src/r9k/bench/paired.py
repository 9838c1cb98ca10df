"""Paired accuracy of stock vs one-page on the same questions (`r9k bench paired`).

Reads two lm-evaluation-harness sample logs (`--log_samples`: one JSON line per question and
filter, e.g. GSM8K's `exact_match` under `strict-match`), pairs them by (doc_id, filter), and
runs the exact McNemar test on the discordant pairs: only questions one mode got right and the
other wrong carry evidence of a difference.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: binomial(n = only_a + only_b, 1/2) tail, doubled."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def load_samples(path: Path, metric: str, filter_name: str | None) -> dict[tuple, dict[str, Any]]:
    rows: dict[tuple, dict[str, Any]] = {}
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = (row["doc_id"], row.get("filter"))
                value = float(row[metric])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected an lm-eval sample line with doc_id and "
                                 f"{metric!r} ({type(exc).__name__}: {exc})") from None
            if filter_name is not None and row.get("filter") != filter_name:
                continue
            rows[key] = {"correct": value >= 0.5, "resps": row.get("filtered_resps")}
    if not rows:
        raise ValueError(f"{path}: no samples" + (f" with filter {filter_name!r}" if filter_name else ""))
    return rows


def paired_test(a: dict[tuple, dict], b: dict[tuple, dict], alpha: float = 0.05) -> dict[str, Any]:
    keys = sorted(set(a) & set(b), key=str)
    both = only_a = only_b = neither = same_answer = 0
    for k in keys:
        ca, cb = a[k]["correct"], b[k]["correct"]
        both += ca and cb
        only_a += ca and not cb
        only_b += cb and not ca
        neither += not ca and not cb
        same_answer += a[k]["resps"] is not None and a[k]["resps"] == b[k]["resps"]
    n = len(keys)
    p = mcnemar_exact_p(only_a, only_b)
    return {"paired": n, "unpaired_a": len(set(a) - set(b)), "unpaired_b": len(set(b) - set(a)),
            "accuracy_a": (both + only_a) / n if n else None,
            "accuracy_b": (both + only_b) / n if n else None,
            "both_right": both, "only_a_right": only_a, "only_b_right": only_b,
            "both_wrong": neither, "identical_answers": same_answer,
            "mcnemar_exact_p": p, "alpha": alpha, "significant": p < alpha}
