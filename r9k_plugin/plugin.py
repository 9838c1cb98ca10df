"""Plugin registration: validate settings, pick the mode, hook the GDN layer and model classes."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("r9k")

GDN_STATE_ENV = "R9K_GDN_STATE"
GDN_STATE_MODES = ("onepage", "stock")

_registered = False


def gdn_state_mode() -> str:
    """The requested page mode; raises ValueError naming the allowed values on a bad setting."""
    value = os.environ.get(GDN_STATE_ENV, "onepage").strip().lower()
    if value not in GDN_STATE_MODES:
        raise ValueError(
            f"{GDN_STATE_ENV}={os.environ.get(GDN_STATE_ENV)!r} is not a GDN state mode; "
            f"expected one of {', '.join(GDN_STATE_MODES)}"
        )
    return value


def register() -> None:
    global _registered
    mode = gdn_state_mode()  # a bad value must stop the engine: let it raise
    if _registered:
        return
    _registered = True
    logger.info("r9k plugin loaded: GDN state mode %s (requested by %s)", mode, GDN_STATE_ENV)
