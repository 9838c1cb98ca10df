"""The `r9k` command line: one click group, one subgroup per component.

Subgroups are imported lazily so `r9k capacity` does not pay for Ray or vLLM imports, and a
component that fails to import breaks only its own subcommand.
"""
from __future__ import annotations

import importlib
import importlib.util
import json

import click

# name -> "module:attribute" of a click command or group; each component owns its entry.
SUBCOMMANDS: dict[str, str] = {
    "capacity": "r9k.cli.capacity:capacity",
    "model": "r9k.devtools.tiny_model:model",
    "demo": "r9k.devtools.demo:demo",
    "ops": "r9k.ops.cli:ops",
    "exporter": "r9k.monitoring.cli:exporter",
    "fleet": "r9k.deploy.cli:fleet",
    "bench": "r9k.bench.cli:bench",
}

# commands of one group that live in a higher layer (name in group -> "module:attribute"):
# `r9k ops sweep` drives the bench client, which ops itself may not import
NESTED: dict[str, dict[str, str]] = {
    "ops": {"sweep": "r9k.bench.cli:ops_sweep"},
}
NESTED_HELP = {("ops", "sweep"): "Step a card's power cap under a fixed load; joules per token "
               "at each cap (the configured cap restored after)."}


class _LazyCommand(click.Command):
    """A subcommand imported when it runs (its module may need an extra the group does not)."""

    def __init__(self, name: str, target: str, help_text: str) -> None:
        super().__init__(name, short_help=help_text, help=help_text, add_help_option=False)
        self.target = target

    def _load(self) -> click.Command:
        module_name, attr = self.target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def make_context(self, info_name, args, parent=None, **extra):
        return self._load().make_context(info_name, args, parent=parent, **extra)


# a package an extra installs -> the extra (`pip install 'r9700-stack[EXTRA]'`); a subcommand
# with an extra of its own names that one (aiohttp and psutil are in fleet and bench)
EXTRA_OF_PACKAGE = {"ray": "fleet", "aiohttp": "fleet", "psutil": "fleet", "tqdm": "bench",
                    "matplotlib": "plot", "safetensors": "dev", "transformers": "dev",
                    "tokenizers": "dev"}
EXTRA_OF_COMMAND = {"fleet": "fleet", "bench": "bench", "model": "dev", "demo": "dev"}


class LazyGroup(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["r9k_json"] = "--json" in args  # seen before a subcommand's own parsing can fail
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            try:
                return super().invoke(ctx)
            except ModuleNotFoundError as exc:  # a command importing its extra's packages
                raise _missing_extra(ctx.invoked_subcommand or "", exc) from None
        except click.ClickException as exc:
            if not ctx.meta.get("r9k_json"):
                raise
            # under --json a refusal is JSON too: what a script reading stdout can parse
            click.echo(json.dumps({"ok": False, "error": exc.format_message(),
                                   "exit_code": exc.exit_code}))
            raise click.exceptions.Exit(exc.exit_code) from None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(n for n in SUBCOMMANDS if _available(n))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                return None  # component not built yet
            raise _missing_extra(name, exc) from None
        command = getattr(module, attr)
        if isinstance(command, click.Group):
            for sub, sub_target in NESTED.get(name, {}).items():
                if sub not in command.commands:
                    command.add_command(_LazyCommand(sub, sub_target, NESTED_HELP[(name, sub)]))
        return command


def _missing_extra(command: str, exc: ModuleNotFoundError) -> Exception:
    """A UsageError naming the extra that installs the missing package, or `exc` itself."""
    package = (exc.name or "").split(".")[0]
    if package not in EXTRA_OF_PACKAGE:
        return exc
    extra = EXTRA_OF_COMMAND.get(command, EXTRA_OF_PACKAGE[package])
    return click.UsageError(f"`r9k {command}` needs {package}, which is not installed; expected "
                            f"the '{extra}' extra: pip install 'r9700-stack[{extra}]'")


def _available(name: str) -> bool:
    module_name = SUBCOMMANDS[name].split(":")[0]
    return importlib.util.find_spec(module_name) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="r9700-stack")
def main() -> None:
    """r9700-stack: serve hybrid GDN models on Radeon AI PRO R9700 fleets with vLLM.

    Exit codes: 0 ok, 1 a check failed or drift was found, 2 bad input.
    """

