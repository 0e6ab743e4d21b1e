"""Settings declared once: ``setting(default, help, min=..., max=..., choices=..., size=...)`` is a dataclass field
that carries its own help, bounds and choices (in ``field.metadata``, the way vLLM's config dataclasses document
their fields in place). From those fields alone come:

* the command line: ``--<name with dashes>`` for each field (``add_arguments``), its help and default in ``--help``;
* the environment: ``KVPOOL_<NAME>`` for each field (``read_sources``); a flag beats its variable, which beats the
  --config file's value (config_file.py), which beats the field's default;
* the checks: one loop (``check_settings``) over every field's choices and bounds, with one message form --
  ``--flag must be >= 1, got 0``, ``--flag must be in (0, 1], got 1.5``, ``--flag must be one of a, b, got 'c'``.

A bound is a number or the name of another setting (``min="max_message_bytes"``: at least that setting's value).
Nothing here reads the OS: the checks of files, CPUs and memory are kvpool_server.host_checks'.
"""

from __future__ import annotations

import argparse
import difflib
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "KVPOOL_"
# Binary multiples. KB/MB/GB are read as KiB/MiB/GiB, as Docker reads them: a pool is sized in powers of two.
_SUFFIXES = {
    "b": 1,
    **{s: 1 << 10 for s in ("k", "kb", "kib")},
    **{s: 1 << 20 for s in ("m", "mb", "mib")},
    **{s: 1 << 30 for s in ("g", "gb", "gib")},
    **{s: 1 << 40 for s in ("t", "tb", "tib")},
}
BYTES_FORMS = "bytes (268435456) or a number with KiB/MiB/GiB (256MiB, 1.5GiB; KB/MB/GB and k/m/g mean the same)"
Bound = int | float | str  # a number, or the name of another setting of the same object


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


def parse_bytes(text: str | int) -> int:
    """``"268435456"``, ``"256MiB"``, ``"256MB"``, ``"256m"``, ``"1GiB"``, ``"1.5 GiB"`` -> bytes.

    Raises ConfigError saying which forms are accepted.
    """
    if isinstance(text, int):
        return text
    value = text.strip().lower().replace("_", "")
    number, multiple = value, 1
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if value.endswith(suffix):
            number, multiple = value[: -len(suffix)].strip(), _SUFFIXES[suffix]
            break
    try:
        amount = float(number) if "." in number or "e" in number else int(number)
    except ValueError:
        raise ConfigError(f"{text!r} is not a size: give {BYTES_FORMS}") from None
    if amount != amount or amount in (float("inf"), float("-inf")):
        raise ConfigError(f"{text!r} is not a size: give {BYTES_FORMS}")
    return int(amount * multiple)


def format_bytes(num: int | float) -> str:
    """268435456 -> ``256MiB``; 1.5 GiB -> ``1.5GiB``; 1000 -> ``1000B`` (the form parse_bytes reads back)."""
    for unit, multiple in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num >= multiple:
            return f"{num / multiple:.4g}{unit}"
    return f"{int(num)}B"


@dataclass(frozen=True)
class Spec:
    """What ``setting()`` records of a field, besides its default and type."""

    help: str
    min: tuple[Bound, ...] = ()
    max: tuple[Bound, ...] = ()
    open_min: bool = False  # the lowest bound is excluded: (0, 1]
    choices: tuple[str, ...] = ()
    size: bool = False  # bytes, in parse_bytes' forms
    normalize: Callable[[str], str] | None = None  # applied to a flag's or variable's text (str.upper: "debug")
    show_default: bool = True


def setting(default: Any, help: str, *, min: Bound | Sequence[Bound] = (), max: Bound | Sequence[Bound] = (),
            open_min: bool = False, choices: Sequence[str] = (), size: bool = False,
            normalize: Callable[[str], str] | None = None, show_default: bool = True) -> Any:
    """A dataclass field declaring one setting: its default, help, bounds (inclusive unless ``open_min``; a str
    names another setting), choices, and whether it is a byte size."""
    spec = Spec(help, _bounds(min), _bounds(max), open_min, tuple(choices), size, normalize, show_default)
    return dataclasses.field(default=default, metadata={"setting": spec})


def _bounds(value: Bound | Sequence[Bound]) -> tuple[Bound, ...]:
    return (value,) if isinstance(value, int | float | str) else tuple(value)


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    return ENV_PREFIX + name.upper()


@dataclass(frozen=True)
class Setting:
    name: str
    type: type  # bool, int, float or str (``X | None`` unwrapped)
    default: Any
    spec: Spec

    @property
    def flag(self) -> str:
        return flag_of(self.name)

    @property
    def env(self) -> str:
        return env_of(self.name)


@functools.cache
def settings_of(cls: type) -> tuple[Setting, ...]:
    """Every field of ``cls`` declared with ``setting()``, in declaration order."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        spec = field.metadata.get("setting")
        if spec is None:
            continue
        found.append(Setting(field.name, _plain_type(hints[field.name]), field.default, spec))
    return tuple(found)


def _plain_type(hint: Any) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint if hint in (bool, int, float, str) else str


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per setting of ``cls``; each parses to None when absent (so the environment can fill it)."""
    for s in settings_of(cls):
        help_text = s.spec.help
        if s.spec.show_default and s.default is not None:
            help_text += f" (default {format_bytes(s.default) if s.spec.size else repr(s.default)})"
        kwargs: dict[str, Any] = {"dest": s.name, "default": None, "help": help_text}
        if s.type is bool:
            kwargs.update(action="store_const", const=True)
        else:
            kwargs["type"] = _flag_parser(s)
            if s.spec.choices:
                kwargs["choices"] = s.spec.choices
        parser.add_argument(s.flag, **kwargs)


def _flag_parser(s: Setting) -> Callable[[str], Any]:
    if s.spec.size:
        return _bytes_arg
    if s.spec.normalize is not None:
        return s.spec.normalize
    return s.type


def _bytes_arg(text: str) -> int:
    """argparse ``type=`` for byte sizes: its message, not argparse's 'invalid parse_bytes value'."""
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def unknown_variables(cls: type, environ: Mapping[str, str], others: Sequence[str] = ()) -> list[str]:
    """A warning for each ``KVPOOL_*`` variable that is none of ``cls``'s settings nor one of ``others`` (other
    tools' variables; a name ending in ``_`` is a prefix), with the setting it most resembles: a misspelt variable
    is otherwise silently ignored."""
    known = {s.env for s in settings_of(cls)}
    warnings = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        if any(name == other or (other.endswith("_") and name.startswith(other)) for other in others):
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(f"{name} is not a kvpool-server setting: ignored{hint}")
    return warnings


def read_sources(cls: type, args: argparse.Namespace, environ: Mapping[str, str],
                 file_values: Mapping[str, Any] | None = None,
                 file_name: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """The values given for ``cls``'s settings -- each flag in ``args``, else its ``KVPOOL_*`` variable, else the
    config file's value (``file_values``, config_file.py); settings given none are left out (the field's default
    applies) -- and for each where it came from: ``flag --x``, ``env KVPOOL_X``, ``file F``."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in settings_of(cls):
        value = getattr(args, s.name)
        source = f"flag {s.flag}"
        if value is None and (raw := environ.get(s.env)) is not None:
            value, source = _parse_env(s, raw), f"env {s.env}"
        if value is None and file_values and s.name in file_values:
            value, source = file_values[s.name], f"file {file_name}"
        if value is not None:
            values[s.name], sources[s.name] = value, source
    return values, sources


_EXPECTED = {int: "an integer", float: "a number such as 0.5", str: "text"}


def _parse_env(s: Setting, raw: str) -> Any:
    """A ``KVPOOL_*`` value, or ConfigError naming the variable, its flag and the accepted form."""
    where = f"{s.env}={raw!r} (as {s.flag})"
    if s.spec.size:
        try:
            return parse_bytes(raw)
        except ConfigError:
            raise ConfigError(f"{where} is not a size: give {BYTES_FORMS}") from None
    if s.type is bool:
        if raw.strip().lower() not in ("1", "true", "yes", "0", "false", "no", ""):
            raise ConfigError(f"{where} must be 1/true/yes or 0/false/no")
        return raw.strip().lower() in ("1", "true", "yes")
    if s.spec.normalize is not None:
        return s.spec.normalize(raw)
    try:
        return s.type(raw)
    except ValueError:
        raise ConfigError(f"{where} must be {_EXPECTED[s.type]}") from None


def check_settings(obj: Any) -> None:
    """The one loop over every setting of ``obj``: its choices and its bounds (a None value is "not given")."""
    for s in settings_of(type(obj)):
        value = getattr(obj, s.name)
        if value is None:
            continue
        if s.spec.choices:
            text = s.spec.normalize(value) if s.spec.normalize else value
            if text not in s.spec.choices:
                raise ConfigError(f"{s.flag} must be one of {', '.join(s.spec.choices)}, got {value!r}")
        if not _within(obj, s, value):
            raise ConfigError(f"{s.flag} must be {_range_text(obj, s)}, got {value}")


def _value_of(obj: Any, bound: Bound) -> int | float:
    return getattr(obj, bound) if isinstance(bound, str) else bound


def _within(obj: Any, s: Setting, value: Any) -> bool:
    lows = [_value_of(obj, b) for b in s.spec.min]
    if lows and s.spec.open_min and not value > lows[0]:
        return False
    if any(value < low for low in lows):
        return False
    return all(value <= _value_of(obj, b) for b in s.spec.max)


def _range_text(obj: Any, s: Setting) -> str:
    def show(bound: Bound) -> str:
        return f"{flag_of(bound)}={getattr(obj, bound)}" if isinstance(bound, str) else str(bound)

    if len(s.spec.min) == 1 and len(s.spec.max) == 1:
        return f"in {'(' if s.spec.open_min else '['}{show(s.spec.min[0])}, {show(s.spec.max[0])}]"
    parts = [(">" if s.spec.open_min and i == 0 else ">=") + f" {show(b)}" for i, b in enumerate(s.spec.min)]
    parts += [f"<= {show(b)}" for b in s.spec.max]
    return " and ".join(parts)
