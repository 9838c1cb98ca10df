"""r9k: vLLM plugin that keeps one GDN state page per request under speculative decoding.

vLLM imports this package in every engine and worker process (entry point
`vllm.general_plugins` -> `r9k:register`), so it stays light: no CLI, no Ray, no r9k.deploy, r9k.ops or
r9k.monitoring imports here.
"""
from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """vLLM plugin entry point; idempotent (vLLM calls it once per process)."""
    from r9k.plugin.entry import register as _register

    _register()
