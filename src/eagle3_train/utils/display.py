"""Numbers and lists as the printed summaries show them: a few significant digits, never a value cut mid-way.

The full values stay in the JSON files the summaries name (summary.json, results.json); a table only has to be read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def number(value: Any, digits: int = 4) -> str:
    """`digits` significant digits (1.235, 0.01235, 123.5); a number with more whole digits than that is shown whole
    with thousands separators (12,346), as are integers; '-' for None; anything else as str."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value) or value == 0:
        return str(value) if value else "0"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    if abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    return f"{value:#.{digits}g}"  # trailing zeros kept: a column of them lines up


def first_few(items: Sequence[Any], shown: int = 5, where: str = "") -> str:
    """The first `shown` items, comma-separated, then how many more there are (and where all of them are)."""
    text = ", ".join(str(x) for x in items[:shown])
    more = len(items) - shown
    if more > 0:
        text += f" and {more} more" + (f" ({where})" if where else "")
    return text
