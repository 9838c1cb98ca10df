"""One wording for configuration errors found by pydantic (ops config, fleet file, replica specs):
where (the field path), what was wrong, what was given and, where known, what was expected. One
YAML reader for the config files, which refuses a key given twice, and one YAML + pydantic
loader (`parse_yaml_model`) that the fleet file, the ops config and the exporter's web config
share."""
from __future__ import annotations

import os
import stat
from typing import Callable, Iterable, TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)

# Parts of an error location that name a type or union branch, not a field the user wrote.
_TYPE_TAG_PREFIXES = ("str", "int", "float", "bool", "list[", "dict[", "function-", "union[",
                      "literal[", "nullable[", "tagged-union[")


def field_path(loc: Iterable[object]) -> str:
    parts = []
    for p in loc:
        text = str(p)
        if isinstance(p, str) and (text.startswith(_TYPE_TAG_PREFIXES)
                                   or (text[:1].isupper() and text.isidentifier())):
            continue  # e.g. "int", "function-after[...]", a model class name in a union
        parts.append(text)
    return ".".join(parts)


def describe_error(error: dict, *, expected: dict[str, str] | None = None,
                   allowed_fields: Callable[[tuple], Iterable[str]] | None = None) -> str:
    """One line for one pydantic error. `expected` maps a field name to the value it wants
    (said when that field is wrong); `allowed_fields(loc)` lists the fields valid at `loc`."""
    loc = tuple(error["loc"])
    where = field_path(loc) or "config"
    kind, given = error["type"], error.get("input")
    msg = error["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        names = list(allowed_fields(loc)) if allowed_fields else []
        line = f"{where}: unknown field {str(loc[-1])!r}"
        return line + (f", expected one of: {', '.join(names)}" if names else "")
    if kind == "missing":
        return f"{where}: required field is missing"
    for name, text in (expected or {}).items():
        if name in (str(p) for p in loc):
            if isinstance(given, str):
                return f"{where}: got the string {given!r}, expected {text}"
            if kind == "value_error":
                return f"{where}: {msg}"
            return f"{where}: got {given!r}, expected {text}"
    if isinstance(given, (dict, list)):
        return f"{where}: {msg}"
    return f"{where}: {msg} (got {given!r})"


def validation_message(exc: ValidationError, source: str, *, limit: int | None = None,
                       **describe) -> str:
    """`source: first problem; second problem ...`; a union reports one error per branch, so
    each distinct line is said once."""
    lines: list[str] = []
    for error in exc.errors():
        line = describe_error(error, **describe)
        if line not in lines:
            lines.append(line)
    return f"{source}: " + "; ".join(lines[:limit])


class YamlKeyError(ValueError):
    """A mapping key a config file cannot mean: given twice, or not a plain scalar."""


class DuplicateKeyError(YamlKeyError):
    """A mapping in a YAML file names one key twice (PyYAML would keep the last silently)."""


# A config file is a few KiB; anything near this is a wrong path (a log, a device, a dump).
CONFIG_MAX_BYTES = 1 << 20


def read_config_bytes(path, max_bytes: int = CONFIG_MAX_BYTES) -> bytes:
    """A config file's bytes, read without blocking or growing without bound: a FIFO, a device
    (`/dev/zero`), a socket or a directory is refused (ValueError naming the path and what it is),
    and so is a file over `max_bytes`. OSError (not found, permission) passes to the caller. The
    open does not block on a FIFO (O_NONBLOCK) and the type is checked on the opened file, so a
    path swapped between check and read cannot slip through."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise ValueError(f"{path}: is {kind}; expected a regular file (YAML)")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 16, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise ValueError(f"{path}: larger than {max_bytes} bytes; expected a config file "
                             "(a few KiB of YAML)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode_config_text(raw: bytes, path) -> str:
    """A config file's bytes as text; ValueError naming the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                         f"{exc.start}); expected a UTF-8 YAML file") from None


def load_yaml_strict(text: str):
    """yaml.safe_load, except that a key given twice in one mapping raises DuplicateKeyError
    naming the key and its line (a list or mapping as a key: YamlKeyError): in a config file the second value silently winning hides a
    mistake (two power caps for one card, two passwords for one user)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):  # `? [a, b]`: unhashable or meaningless
                raise YamlKeyError(f"a {key_node.id} used as a key (line "
                                   f"{key_node.start_mark.line + 1}); expected a plain name")
            key = loader.construct_object(key_node, deep=True)
            if key in seen:
                raise DuplicateKeyError(f"duplicate key {key!r} (line "
                                        f"{key_node.start_mark.line + 1}); expected each key once")
            seen.add(key)
        return loader.construct_mapping(node, deep=True)

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def parse_yaml_model(text: str, model: type[Model], source: str, error: type[ValueError], *,
                     top_level: str = "a mapping", empty: dict | None = None,
                     **message) -> Model:
    """A YAML config file's text as a validated `model`. Every problem is raised as `error`,
    starting with `source`: a key given twice, text that is not YAML, a top level that is not a
    mapping (`top_level` says what is expected there; `empty` stands for an empty file, where
    one is allowed), and the model's field errors (`validation_message`, `message` its options)."""
    import yaml

    try:
        data = load_yaml_strict(text)
    except YamlKeyError as exc:
        raise error(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise error(f"{source}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None and empty is not None:
        data = empty
    if not isinstance(data, dict):
        raise error(f"{source}: expected {top_level} at the top level, got "
                    f"{type(data).__name__}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(validation_message(exc, source, **message)) from None
