import sys
from pathlib import Path

# tests/engine/scenarios.py is shared by the engine tests and the demo
sys.path.insert(0, str(Path(__file__).parent / "engine"))
