"""kvpool-server's settings from a TOML file (``--config kvpool.toml``), and where each value came from.

The file's keys are the settings' own names (``pool_bytes = "1GiB"``, ``log_format = "json"``), one flat table.
Precedence, highest first::

    --flag  >  KVPOOL_<NAME>  >  the --config file  >  the default

A key that is no setting is refused with the nearest name (``pool_byte``: did you mean pool_bytes?), as is a value
of the wrong TOML type; sizes take an integer of bytes or parse_bytes' text (``"256MiB"``). ``render`` writes the
merged settings back as TOML, each line with its source (``--print-config``): the output is itself a config file.
The file is read once, at start; it is bounded by the settings it may hold (a file over ``MAX_FILE_BYTES`` is
refused before it is parsed).
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Mapping
from typing import Any

from kvpool_server.settings import BYTES_FORMS, ConfigError, Setting, format_bytes, parse_bytes, settings_of

MAX_FILE_BYTES = 1 << 20  # a config file is a few KiB; anything larger is not one
CONFIG_ENV = "KVPOOL_CONFIG"
_TOML_TYPES = {bool: "true or false", int: "an integer", float: "a number", str: "a quoted string"}


def read_config_file(path: str, cls: type) -> dict[str, Any]:
    """The settings of ``cls`` that the TOML file at ``path`` gives, parsed and typed; ConfigError naming the file
    (and the key) otherwise. Bounds and combinations are checked later, with the merged settings."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"--config {path}: larger than {format_bytes(MAX_FILE_BYTES)}, not a kvpool config file")
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: not TOML ({exc})") from None
    known = {s.name: s for s in settings_of(cls)}
    values = {}
    for key, value in table.items():
        if key not in known:
            close = difflib.get_close_matches(key.replace("-", "_"), sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else " (the settings: kvpool-server --print-config)"
            raise ConfigError(f"--config {path}: {key!r} is not a kvpool-server setting{hint}")
        values[key] = _typed(known[key], value, path)
    return values


def _typed(s: Setting, value: Any, path: str) -> Any:
    where = f"--config {path}: {s.name} = {_toml(value) if not isinstance(value, dict) else '{...}'}"
    if s.spec.size:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return parse_bytes(value)
            except ConfigError:
                pass
        raise ConfigError(f"{where} is not a size: give {BYTES_FORMS}, the text quoted")
    if s.type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not s.type:
        raise ConfigError(f"{where} must be {_TOML_TYPES[s.type]}")
    if s.spec.normalize is not None and isinstance(value, str):
        return s.spec.normalize(value)
    return value


def render(config: Any, sources: Mapping[str, str]) -> str:
    """``config``'s settings as TOML, each with the source of its value (``sources``: name -> source; the rest
    are defaults). A setting with no value (None) is written as a comment."""
    lines = ["# kvpool-server --print-config: the merged settings (flags > KVPOOL_* > --config file > defaults)"]
    for s in settings_of(type(config)):  # type: ignore[arg-type]  # mypy: type[Any] is not Hashable
        value = getattr(config, s.name)
        source = sources.get(s.name, "default")
        if value is None:
            lines.append(f"# {s.name} = (not set)".ljust(48) + f"  # {source}")
            continue
        if s.spec.size and parse_bytes(format_bytes(value)) == value:
            text = _toml(format_bytes(value))
        else:
            text = _toml(value)
        lines.append(f"{s.name} = {text}".ljust(48) + f"  # {source}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
