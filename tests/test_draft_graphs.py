"""r9k.plugin.draft_graphs: the draft model's later MTP steps get a CUDA graph at max_num_seqs.

vLLM's own `VllmConfig._set_cudagraph_sizes` (the installed 0.32 source) runs here on a config
double; what it computes is what a GPU engine captures (the V2 runner's draft decode graphs take
the sizes up to max_num_seqs). The speed-up itself is measured on the GPU engine
(lab/results/gpu_perf_draft_graphs_k3_summary_h200.md)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from r9k.plugin import policy
from r9k.plugin.draft_graphs import install


def config(max_num_seqs: int, k: int, sizes: list[int] | None = None):
    """The fields `_set_cudagraph_sizes` reads, around vLLM's real CompilationConfig."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                           **({"cudagraph_capture_sizes": sizes} if sizes else {}))
    spec = SimpleNamespace(num_speculative_tokens=k,
                           uses_dynamic_speculative_decoding=lambda: False) if k else None
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False), compilation_config=cc,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
        speculative_config=spec, uniform_decode_query_len=k + 1, performance_mode="balanced",
        num_speculative_tokens=k)


def vllms():
    """vLLM's own method, whether or not a test before this one registered the plugin here."""
    from vllm.config import VllmConfig

    method = VllmConfig._set_cudagraph_sizes
    return getattr(method, "__wrapped__", method)


@pytest.fixture
def wrapped():
    """A subclass carrying vLLM's own method gets the wrapper: vLLM's class stays as it is."""
    from vllm.config import VllmConfig

    cls = type("WrappedConfig", (VllmConfig,), {"_set_cudagraph_sizes": vllms()})
    assert install(cls)
    first = cls._set_cudagraph_sizes
    assert first.r9k_wrapped and install(cls) and cls._set_cudagraph_sizes is first  # once
    assert not install(type("NoSizes", (), {}))  # a release without the method
    return cls


def draft_sizes(cfg) -> list[int]:
    """The sizes the V2 runner's draft decode graphs take: those up to max_num_seqs."""
    return [s for s in cfg.compilation_config.cudagraph_capture_sizes
            if s <= cfg.scheduler_config.max_num_seqs]


def test_vllm_leaves_5_to_7_requests_without_a_draft_graph():
    """The defect, in vLLM's own code: at max_num_seqs 7 (one-page's planner count on the perf
    model) the draft steps' largest graph is 4 requests."""
    cfg = config(7, 3)
    vllms()(cfg)
    assert draft_sizes(cfg) == [1, 2, 4]
    assert cfg.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24, 28, 32, 40, 48, 56]


@pytest.mark.parametrize("seqs, k, expected", [
    (7, 3, [1, 2, 4, 7]), (12, 7, [1, 2, 4, 8, 12]), (5, 2, [1, 2, 3, 4, 5]),
    (4, 3, [1, 2, 4]), (8, 3, [1, 2, 4, 8]), (16, 7, [1, 2, 4, 8, 16])])
def test_max_num_seqs_gets_its_graph(wrapped, seqs, k, expected):
    cfg, before = config(seqs, k), config(seqs, k)
    wrapped._set_cudagraph_sizes(cfg)
    vllms()(before)
    assert draft_sizes(cfg) == expected
    added = set(cfg.compilation_config.cudagraph_capture_sizes) - set(
        before.compilation_config.cudagraph_capture_sizes)
    assert added == ({seqs} - set(before.compilation_config.cudagraph_capture_sizes))


def test_sizes_compiled_for_follow(wrapped):
    """compile_sizes: ["cudagraph_capture_sizes"] (vLLM expands it inside the method) gets the
    added size too."""
    cfg = config(7, 3)
    cfg.compilation_config.compile_sizes = ["cudagraph_capture_sizes"]
    wrapped._set_cudagraph_sizes(cfg)
    assert 7 in cfg.compilation_config.compile_sizes
    assert set(cfg.compilation_config.compile_sizes) == set(cfg.compilation_config.cudagraph_capture_sizes)


def test_what_is_left_as_vllm_has_it(wrapped, monkeypatch):
    """One draft token (no later draft steps), sizes a user gave, and R9K_DRAFT_GRAPHS=0 keep
    vLLM's sizes."""
    for args, kwargs in (((7, 1), {}), ((7, 3), {"sizes": [1, 2, 4, 8]})):
        cfg, ref = config(*args, **kwargs), config(*args, **kwargs)
        wrapped._set_cudagraph_sizes(cfg)
        vllms()(ref)
        assert cfg.compilation_config.cudagraph_capture_sizes == \
            ref.compilation_config.cudagraph_capture_sizes, (args, kwargs)
    monkeypatch.setenv(policy.DRAFT_GRAPHS_ENV, "0")
    cfg = config(7, 3)
    wrapped._set_cudagraph_sizes(cfg)
    assert draft_sizes(cfg) == [1, 2, 4]


def test_the_pure_rule():
    assert policy.draft_capture_sizes([1, 2, 4, 8], 7, 3, 8) == [1, 2, 4, 7, 8]
    assert policy.draft_capture_sizes([1, 2, 4, 8], 7, 1, 8) is None   # no later draft steps
    assert policy.draft_capture_sizes([1, 2, 4, 8], 8, 3, 8) is None   # there already
    assert policy.draft_capture_sizes([], 7, 3, 0) is None             # no graphs
    assert policy.draft_capture_sizes([1, 2, 4], 7, 3, 4) is None      # past vLLM's ceiling


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_a_bad_setting_stops_registration(monkeypatch, value):
    import r9k.plugin.entry as plugin
    from r9k.plugin import runtime

    monkeypatch.setenv(policy.DRAFT_GRAPHS_ENV, value)
    with pytest.raises(ValueError, match=r"R9K_DRAFT_GRAPHS=.*expected 1 \(default\) or 0"):
        policy.draft_graphs()
    # as if registered already: the setting is checked on every call, as the mode is
    monkeypatch.setattr(runtime.current(), "registered", {"plugin"})
    with pytest.raises(ValueError, match="R9K_DRAFT_GRAPHS"):
        plugin.register()


def test_registration_wraps_vllms_config():
    """The plugin's register() (as vLLM's plugin loader calls it) wraps the real VllmConfig."""
    import subprocess
    import sys

    code = ("from r9k import register; register(); from vllm.config import VllmConfig; "
            "m = VllmConfig._set_cudagraph_sizes; print(getattr(m, 'r9k_wrapped', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
