"""A one-rank gloo process group for building vLLM layers and models outside an engine (vLLM's
layers read the tensor-parallel size when they are constructed)."""
from __future__ import annotations

import contextlib
import tempfile


@contextlib.contextmanager
def one_rank_group():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
