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


# --- prefix caching (mamba_cache_mode "align") -------------------------------------------------

SHARED = prompt(800, 301)  # byte-level tokenizer: 3 blocks of 256 tokens
MAX_TOKENS = 24
SMALL_POOL_KV_BYTES = 8 << 20  # tiny, k = 3: 5,041 tokens stock, 6,553 one-page; 8 x ~1,300 preempts


def prefix_scenarios(shared: str = SHARED, near_ends: tuple[int, ...] = (250, 500, 760)
                     ) -> list[dict]:
    """A cold round whose prompts end just under block ends (`near_ends`, 256-token blocks by
    default: decode crosses a boundary), the same prompts warm and others sharing several blocks
    of prefix (hits), a request joining while one with the same prefix runs, multi-turn
    conversations re-sent with their history."""
    first = shared + prompt(40, 302)
    return [
        {"name": "cold", "kind": "batch", "max_tokens": MAX_TOKENS,
         "prompts": [first] + [prompt(n, 303 + i) for i, n in enumerate(near_ends)]},
        {"name": "warm", "kind": "batch", "max_tokens": MAX_TOKENS,
         "prompts": [first, shared + prompt(60, 305), shared[:600] + prompt(30, 306),
                     prompt(near_ends[1], 304)]},
        {"name": "join", "kind": "join", "steps_between": 3, "max_tokens": MAX_TOKENS,
         "waves": [[shared + prompt(50, 307)], [shared + prompt(45, 308)]]},
        {"name": "chat", "kind": "chat", "max_tokens": MAX_TOKENS,
         "conversations": [[shared[:300] + prompt(40, 310), prompt(30, 311), prompt(200, 312)],
                           [prompt(230, 313), prompt(25, 314), prompt(20, 315)]]},
    ]


def preempt_scenarios() -> list[dict]:
    """Eight long requests sharing a prefix: more than a small pool holds (preemption)."""
    shared = prompt(520, 320)
    return [{"name": "crowd", "kind": "batch", "max_tokens": 48,
             "prompts": [shared + prompt(700 + 40 * i, 330 + i) for i in range(8)]}]
