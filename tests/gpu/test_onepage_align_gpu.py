"""On a GPU: prefix caching's state copies on one-page pages (`replay_into` over vLLM's stock
Triton kernel, the composed backend) against stock's slot copies, bit for bit, over multi-step
runs with random acceptance and random pre-copies, boundary copies (into an earlier block and in
place) and prefix hits. This is the composed path, with host-side indexing: the fused,
CUDA-graph-safe boundary kernel is not built yet."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

from r9k.kernels.onepage import GdnHeads  # noqa: E402
from r9k.kernels.simulate import ALIGN_EVENTS, run_align_simulation  # noqa: E402

SHAPES = {"27b-tp2": GdnHeads(8, 24, 128, 128), "small": GdnHeads(2, 4, 64, 64)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("num_spec", [3, 7])
def test_align_copies_match_stock_on_gpu(shape, state, num_spec):
    from r9k.kernels.triton_sim import composed_backend

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[state]
    counts, replayed = run_align_simulation(composed_backend, SHAPES[shape], dtype, num_seqs=8,
                                            num_spec=num_spec, steps=8, seed=num_spec,
                                            device="cuda")
    assert all(counts[e] > 0 for e in ALIGN_EVENTS), counts
    assert {0, 1} <= set(replayed) and max(replayed) > 1, sorted(set(replayed))
