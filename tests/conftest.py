"""Shared fixtures. Test doubles live in tests/doubles (importable as `doubles.*`: pytest's
`pythonpath = ["tests", "."]` in pyproject.toml, the checkout root for `lab.*`)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Python processes the tests start (kernel cases under the interpreter, engines) import the lab
# from the checkout too: no wheel carries it.
_CHECKOUT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_CHECKOUT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _CHECKOUT])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The default tiny hybrid model, generated once per test session (seed 0)."""
    from r9k.devtools.tiny_model import make_tiny

    path = tmp_path_factory.mktemp("tiny-model") / "tiny"
    make_tiny(path, seed=0)
    return path
