"""Sizes as people write them: '24GiB', '512M', '2g' (binary units) or a number of bytes."""

from __future__ import annotations

import re

from llmq.errors import InputError

SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str | int, option: str) -> int:
    """Bytes from a size (InputError naming `option` for anything else)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not found:
        raise InputError(f"{option} {text!r}: expected a size such as 16GiB or 512MiB")
    return int(float(found.group(1)) * SIZE_UNITS[found.group(2)])
