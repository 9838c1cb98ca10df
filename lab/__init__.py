"""The lab: research kernels, simulations, the GPU machine's staging and the measurement
harnesses. Not shipped (the wheel carries `src/r9k` only); run from the checkout
(`python -m lab.scripts.NAME`) and imported by its tests as `lab.*`."""


def command_line(python: str = "python3") -> str:
    """This run's command as one would type it again, for the results it writes:
    `python3 -m lab.scripts.NAME ARGS` (under `-m`, sys.argv[0] is the file's absolute path)."""
    import sys

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"-m {spec.name}" if spec is not None and spec.name else sys.argv[0]
    return " ".join([python, prog, *sys.argv[1:]])
