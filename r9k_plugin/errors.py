"""The command line's error for bad input, shared by every subcommand (none imports the CLI root)."""
from __future__ import annotations

import click


class BadInput(click.ClickException):
    """Bad input: a one-line message naming what was wrong and what was expected; exit 2."""

    exit_code = 2
