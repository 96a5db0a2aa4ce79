"""Byte sizes as people write them ('20GiB', '512MB') and as llmtune prints them.

Its own module so that recipe validation, the estimator and the CLI can share it without importing each other.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """'20GiB' -> 21474836480; '1.5GB' -> 1500000000; ints pass through."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {text!r} (e.g. '20GiB', '512MB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """Binary units, 3 significant digits: 1536 -> '1.50 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
