"""r9k.plugin.align_graphs' setting: checked at registration (a bad value stops the engine at start
and replaces nothing), `0` runs the align copies eagerly. The captures themselves need a GPU:
tests/gpu/test_onepage_align_hook_gpu.py::test_repeated_launches_replay_as_a_cuda_graph."""
from types import SimpleNamespace

import pytest

from r9k.plugin import align_graphs, onepage_align


@pytest.fixture(autouse=True)
def _fresh():
    align_graphs.reset()
    yield
    align_graphs.reset()


def test_a_bad_setting_is_refused_at_registration(monkeypatch):
    monkeypatch.setenv("R9K_ALIGN_GRAPHS", "sometimes")
    sentinel = object()
    module = SimpleNamespace(precopy_mamba_align_fused_kernel=sentinel,
                             postprocess_mamba_fused_kernel=sentinel)
    with pytest.raises(ValueError, match=r"R9K_ALIGN_GRAPHS='sometimes': expected 1 \(default\) or 0"):
        onepage_align.install_gpu_kernels(module)
    assert module.precopy_mamba_align_fused_kernel is sentinel  # nothing replaced
    assert module.postprocess_mamba_fused_kernel is sentinel


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), ("1", True), (" ON ", True)])
def test_the_setting(monkeypatch, value, on):
    monkeypatch.setenv("R9K_ALIGN_GRAPHS", value)
    assert align_graphs.enabled() is on


def test_off_runs_every_launch_eagerly(monkeypatch):
    monkeypatch.setenv("R9K_ALIGN_GRAPHS", "0")
    calls = []
    for _ in range(3):
        align_graphs.run(lambda args, onepage: calls.append((args, onepage)), ("k",),
                         {"num_reqs": 2}, {1: None})
    assert calls == [({"num_reqs": 2}, {1: None})] * 3
    assert align_graphs.stats() == {"graphs": 0, "captures": 0, "replays": 0, "eager": 3}
