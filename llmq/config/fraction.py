"""Fractions as people write them: `0.03` or `3%`. One parser for every option that takes a
share (a sparsity, a gate's threshold, a dampening), so that a percentage works wherever a
fraction does: the CLI's flags through `llmq.cli.options.fraction`, config fields through
`Fraction`.
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import BeforeValidator

EXPECTED = "a percentage like 3% or a fraction like 0.03"


def parse_fraction(value: str | float) -> float:
    """'3%' -> 0.03, '0.03' -> 0.03, 0.03 -> 0.03: a percentage is the same float as the
    fraction written out ('0.1%' == 0.001). ValueError for anything else, NaN and inf included;
    the range is the option's to check."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r}: expected {EXPECTED}")
    if isinstance(value, int | float):
        number = float(value)
    else:
        text = str(value).strip()
        try:  # Decimal: the percentage divided exactly, then rounded once
            number = float(Decimal(text[:-1]) / 100) if text.endswith("%") else float(text)
        except (InvalidOperation, ValueError):
            raise ValueError(f"{value!r}: expected {EXPECTED}") from None
    if not math.isfinite(number):
        raise ValueError(f"{value!r}: expected {EXPECTED}")
    return number


def _from_text(value: Any) -> Any:
    return parse_fraction(value) if isinstance(value, str) else value


# A config field that takes a fraction: `sparsity: 50%` in a recipe file is `sparsity: 0.5`.
Fraction = Annotated[float, BeforeValidator(_from_text)]
