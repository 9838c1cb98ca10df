"""Put on an engine's PYTHONPATH by tests: vLLM's Qwen3.5 and Qwen4Exp model modules import
torchvision at module level, and PyPI's torchvision breaks this CPU torch build, so the engine
process gets the empty stand-in packages of doubles.vllm_accounting (nothing they provide is
called by a text-only engine). transformers and vLLM are imported first, as there: they decide
torchvision's absence before the stand-in exists."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/, for `doubles`

import transformers  # noqa: E402,F401
import vllm  # noqa: E402,F401

from doubles import vllm_accounting  # noqa: E402

for _name in vllm_accounting._STAND_IN_PACKAGES:
    sys.modules.setdefault(_name, vllm_accounting._stand_in_module(_name))
