"""The command line's bad-input error and option types, shared by every subcommand (none imports
the CLI root)."""
from __future__ import annotations

import math

import click


class BadInput(click.ClickException):
    """Bad input: a one-line message naming what was wrong and what was expected; exit 2."""

    exit_code = 2


class FiniteFloat(click.FloatRange):
    """The one rule for every float option: a finite number in range (click's FloatRange lets
    nan through every comparison, and inf through an open top); exit 2 naming the range."""

    name = "finite float"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number; expected {self._describe_range()}",
                      param, ctx)
        return rv
