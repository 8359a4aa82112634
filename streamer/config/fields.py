"""One parser per kind of configuration value, the same for a value given to a config's
constructor, read from its environment variable or passed through vLLM's extra config: sizes
take ``16MiB`` or ``16777216``, counts ``4`` or ``"4"``, flags ``True``, ``1``, ``"yes"`` or
``"off"``. A value that is none of what a field accepts is a ``ConfigError`` naming the field
(and its variable), the value and what the field accepts.

A config declares each field with ``setting(parser, default, env=...)``; its ``__post_init__``
calls ``parse_fields``, which replaces every declared field's value by its parsed form.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from streamer.errors import ConfigError

Parser = Callable[[object], Any]
"""Turns a value as given into the field's value, or raises ``ValueError`` saying what is accepted."""

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_PATTERN = r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$"  # compiled at first use (re caches it)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("", "none")


def setting(
    parse: Parser, default: object = None, *, env: str | Sequence[str] = (), repr: bool = True
) -> Any:
    """A config field: its value comes from the constructor, else the first of ``env`` that is set
    to something (read when the config is built), else ``default``; ``parse_fields`` parses it."""
    names = (env,) if isinstance(env, str) else tuple(env)

    def from_environment() -> object:
        for name in names:
            raw = os.environ.get(name)
            if raw is not None and raw.strip():
                return raw.strip()
        return default() if callable(default) else default

    return dataclasses.field(
        default_factory=from_environment, repr=repr, metadata={"parse": parse, "env": names}
    )


def parse_fields(config: object, *, section: str = "") -> None:
    """Replaces each ``setting`` field of the frozen dataclass ``config`` by its parsed value."""
    config_class: Any = type(config)  # a class is hashable; mypy's view of type[object] is not
    for name, parse, names in _settings(config_class):
        value = getattr(config, name)
        try:
            parsed = parse(value)
        except ValueError as error:
            where = f"{section}{name}" + (f" ({', '.join(names)})" if names else "")
            raise ConfigError(f"{where}: {value!r} is not {error}") from None
        object.__setattr__(config, name, parsed)


def variables(*config_classes: type) -> frozenset[str]:
    """Every environment variable that the ``setting`` fields of ``config_classes`` read."""
    return frozenset(name for cls in config_classes for _, _, names in _settings(cls) for name in names)


def environment_snapshot(names: frozenset[str]) -> tuple[tuple[str, str], ...]:
    """The variables of ``names`` that are set, with their values: equal snapshots, equal configs.
    It walks the environment's keys once (~6 us), where asking for each of ~50 names costs ~50 us
    (``os.environ.get`` of an unset variable raises and catches a ``KeyError``)."""
    return tuple(sorted((name, os.environ.get(name, "")) for name in names.intersection(os.environ)))


@functools.cache
def _settings(config_class: type) -> tuple[tuple[str, Parser, tuple[str, ...]], ...]:
    """The ``setting`` fields of a config class: name, parser, variables (looked up once per class)."""
    return tuple(
        (field.name, field.metadata["parse"], field.metadata["env"])
        for field in dataclasses.fields(config_class)
        if "parse" in field.metadata
    )


def parse_size(text: str | int, *, name: str) -> int:
    """Parses ``"64MiB"``, ``"2G"``, ``"4096"`` (binary units) into bytes."""
    try:
        parsed: int = size()(text)
    except ValueError as error:
        raise ConfigError(f"{name}: {text!r} is not {error}") from None
    return parsed


def size(minimum: int = 1, *, optional: bool = False) -> Parser:
    """Bytes: an int or a size such as ``16MiB``, ``2G``, ``4096`` (binary units)."""

    def parse(value: object) -> int | None:
        if optional and _is_none(value):
            return None
        what = f"a size of at least {minimum} bytes (an integer, or like 8MiB, 2G)"
        if isinstance(value, bool):
            raise ValueError(what)
        if isinstance(value, str):
            match = re.match(_SIZE_PATTERN, value, re.IGNORECASE)
            if match is None:
                raise ValueError(what)
            value = int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
        if not isinstance(value, int) or value < minimum:
            raise ValueError(what)
        return value

    return parse


def count(low: int = 1, high: int | None = None, *, optional: bool = False) -> Parser:
    """A whole number in ``low..high``: an int or its digits."""
    bounds = f"in {low}..{high}" if high is not None else f"of at least {low}"

    def parse(value: object) -> int | None:
        if optional and _is_none(value):
            return None
        number = _integer(value)
        if number is None or number < low or (high is not None and number > high):
            raise ValueError(f"a whole number {bounds}" + (" (or None)" if optional else ""))
        return number

    return parse


def seconds(*, optional: bool = False) -> Parser:
    """A positive number of seconds: an int, a float or its digits."""

    def parse(value: object) -> float | None:
        if optional and _is_none(value):
            return None
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is None or not math.isfinite(number) or number <= 0:
            raise ValueError("a positive number of seconds" + (" (or None)" if optional else ""))
        return number

    return parse


def flag(*, optional: bool = False) -> Parser:
    """True or False: a bool, 1 / 0, or yes / no, true / false, on / off."""

    def parse(value: object) -> bool | None:
        if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto"))):
            return None
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(
            "true or false (1/0, yes/no, on/off)" + (" or None (decided by the machine)" if optional else "")
        )

    return parse


def choice(options: Sequence[str]) -> Parser:
    """One of ``options`` (any case)."""

    def parse(value: object) -> str:
        text = value.strip().lower() if isinstance(value, str) else ""
        if text not in options:
            raise ValueError(f"one of {', '.join(options)}")
        return text

    return parse


def text(*, optional: bool = True) -> Parser:
    """A string (a path may be an ``os.PathLike``); None where ``optional``."""

    def parse(value: object) -> str | None:
        if value is None and optional:
            return None
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str) and value.strip():
            return value
        raise ValueError("a non-empty string" + (" or None" if optional else ""))

    return parse


def _is_none(value: object) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in _NONE)


def _integer(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    return None
