"""The lab's programs (lab/scripts/) import as modules of the `lab.scripts` package."""
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    return importlib.import_module(f"lab.scripts.{name}")
