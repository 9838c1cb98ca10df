"""Plugin registration: validate settings, hook the GDN layer class and the model classes."""
from __future__ import annotations

import logging

from r9k.policy import GDN_STATE_ENV, gdn_state_mode, vllm_version_reason

logger = logging.getLogger("vllm.r9k")

_registered = False


def register() -> None:
    """Called by vLLM in every engine and worker process (entry point vllm.general_plugins)."""
    global _registered
    mode = gdn_state_mode()  # a bad value raises here, which stops the engine at start
    if _registered:
        return
    _registered = True
    reason = vllm_version_reason()
    if reason:
        logger.warning("r9k plugin loaded: stock GDN state pages: %s", reason)
        return
    from r9k import models
    from r9k.gdn_layer import register_layer

    register_layer()
    models.register_models()
    logger.info("r9k plugin loaded: GDN state mode %s (%s)%s", mode, GDN_STATE_ENV,
                "; pages are decided per engine" if mode == "onepage" else "")
