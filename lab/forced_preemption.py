"""A vLLM scheduler that preempts at points fixed by the token stream, not by the pool.

Comparing stock and one-page under preemption needs both engines to preempt the same request at
the same step. A small pool cannot give that: one-page's pool holds more requests, so the two
engines preempt at different steps and batch differently, and on a GPU (kernels not batch
invariant) two stock engines scheduled differently differ too. This scheduler makes vLLM's own
preemption path run where the token stream says: the first time a running request that was
never preempted asks for blocks with at least `R9K_FORCED_PREEMPT_AFTER_TOKENS` output tokens
while another request runs, its allocation fails once, and vLLM preempts as it does on a full
pool (the last running request: freed pages, back to waiting, recomputed, with prefix caching
from its cached blocks). Identical tokens give identical schedules, so the engines stay
comparable bit for bit. The pool itself stays roomy.

    LLM(..., scheduler_cls="lab.forced_preemption.forced_preemption_scheduler")

A measurement harness (lab/scripts/gpu_engine.py, the engine tests), never a serving setting.
"""
from __future__ import annotations

import os
from typing import Any

ENV = "R9K_FORCED_PREEMPT_AFTER_TOKENS"


def after_tokens() -> int:
    raw = os.environ.get(ENV, "")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={raw!r}: expected a whole number of output tokens >= 1")
    return n


def _forcing(base: type) -> type:
    class Forced(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.r9k_after_tokens = after_tokens()
            self.r9k_forced: list[str] = []  # request ids whose allocation was failed, in order
            real = self.kv_cache_manager.allocate_slots

            def allocate_slots(request, *a: Any, **kw: Any):
                from vllm.v1.request import RequestStatus

                if (request.status == RequestStatus.RUNNING and request.num_preemptions == 0
                        and len(self.running) >= 2
                        and request.num_output_tokens >= self.r9k_after_tokens
                        and request.request_id not in self.r9k_forced):
                    self.r9k_forced.append(request.request_id)
                    return None  # the pool "is full" once: vLLM preempts its last running request
                return real(request, *a, **kw)

            self.kv_cache_manager.allocate_slots = allocate_slots

    Forced.__name__ = Forced.__qualname__ = f"Forced{base.__name__}"
    return Forced


def forced_preemption_scheduler(*args: Any, **kwargs: Any):
    """vLLM calls `scheduler_cls(vllm_config=..., ...)`: build the forcing variant of the
    scheduler vLLM would have used (AsyncScheduler where async scheduling is on)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    cfg = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    base = AsyncScheduler if cfg.scheduler_config.async_scheduling else Scheduler
    return _forcing(base)(*args, **kwargs)
