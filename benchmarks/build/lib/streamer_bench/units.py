"""Sizes and rates: parsing what people type, printing what people read."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"4GiB"``, ``"512M"``, ``"1.5g"``, ``"4096"`` -> bytes (binary units, as ``ls -h``)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"cannot parse size {text!r} (examples: 4GiB, 512MiB, 1.5G, 4096)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return int(value)


def format_bytes(n: float) -> str:
    """Binary units with three significant digits: ``4.00 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s, the unit storage and memory bandwidth are quoted in."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def nonnegative_seconds(text: str) -> float:
    """An argparse type: seconds from 0 up to an hour, with a usage error that says so."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds from 0 to 3600")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1, with a usage error that says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
