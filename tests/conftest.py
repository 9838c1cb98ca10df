"""Shared fixtures. Test doubles live in tests/doubles (importable as `doubles.*`: pytest's
`pythonpath = ["tests"]` in pyproject.toml)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The default tiny hybrid model, generated once per test session (seed 0)."""
    from r9k.devtools.tiny_model import make_tiny

    path = tmp_path_factory.mktemp("tiny-model") / "tiny"
    make_tiny(path, seed=0)
    return path
