"""Deterministic prompts and engine scenarios shared by the engine tests and the benchmarks."""
import random

WORDS = ("alpha beta gamma delta page state record replay verify token block cache layer head "
         "value key query draft accept reject card fleet power watt volt queue batch").split()
# a few tokens to a few thousand (the tiny model's tokenizer is byte-level: ~1 token per char)
PROMPT_LENGTHS = [3, 5, 9, 14, 22, 40, 64, 100, 160, 256, 400, 640, 900, 1300, 2000, 2900, 3500]


def prompt(length: int, seed: int) -> str:
    rng = random.Random(seed)
    text = ""
    while len(text) < length:
        text += rng.choice(WORDS) + " "
    return text[:length]


def mixed_prompts() -> list[str]:
    return [prompt(n, i) for i, n in enumerate(PROMPT_LENGTHS)]


def scenarios(max_tokens: int = 24) -> list[dict]:
    copy = prompt(48, 99)
    return [
        {"name": "batch", "kind": "batch", "prompts": mixed_prompts(), "max_tokens": max_tokens},
        {"name": "copies", "kind": "batch", "prompts": [copy] * 4, "max_tokens": max_tokens},
        {"name": "alone", "kind": "batch", "prompts": [copy], "max_tokens": max_tokens},
        {"name": "join", "kind": "join", "steps_between": 3, "max_tokens": max_tokens,
         "waves": [[prompt(30, 201), prompt(700, 202), prompt(12, 203)],
                   [prompt(1500, 204), prompt(7, 205)],
                   [prompt(90, 206), prompt(90, 206), prompt(2500, 207)]]},
    ]
