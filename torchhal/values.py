"""The value rules every part of torchhal applies at its public faces.

One integer rule (any integer but a bool, held as a plain int), one flag rule (a real
bool), one way to name a hostile value in a message (a short repr), one reader of decimal
text. Nothing here imports torch or another torchhal module: every room may import it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import cast

#: The largest size, length or count a config may give (int32 indexing everywhere).
MAX_SIZE = 2**31 - 1

#: Digits `parse_decimal` reads: any rank, size or token id fits; Python refuses past 4300.
MAX_DECIMAL_DIGITS = 30


def as_index(value: object) -> int | None:
    """`value` as a plain int when it is an integer (Python, numpy or a one-element torch
    integer tensor; not a bool: True is no size, rank or token), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_indices(values: Iterable[object], minimum: int) -> tuple[int, ...] | None:
    """Each of `values` as a plain int >= `minimum` (read as `as_index` reads one), or None
    if any is not one."""
    numbers = tuple(map(as_index, values))
    if any(n is None or n < minimum for n in numbers):
        return None
    return cast(tuple[int, ...], numbers)


def check_buckets(label: str, buckets: object, example: str = "(1, 8, 32)",
                  kind: type = Sequence) -> tuple[int, ...]:
    """Graph buckets: a non-empty `kind` (a config's are tuples) of positive integers (numpy's
    too, not bools; not a str), returned sorted, each once, as plain ints."""
    held = isinstance(buckets, kind) and not isinstance(buckets, str)
    sizes = as_indices(cast(Sequence[object], buckets), 1) if held else None
    if not sizes:
        raise ValueError(f"{label} = {short_repr(buckets)} must be a non-empty {kind.__name__.lower()} of "
                         f"positive ints, e.g. {example}")
    return tuple(sorted(set(sizes)))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def short_repr(value: object, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: one short line however large a hostile value is."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_bool(label: str, value: object) -> None:
    """A flag: a real bool, not a truthy stand-in ("no" and "false" are truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{label} = {short_repr(value)} must be True or False")


def parse_decimal(text: str) -> int | None:
    """`text` as an int when it is plain ASCII digits with an optional minus sign, at most
    `MAX_DECIMAL_DIGITS` of them, else None. `int()` alone would also take "1_0" (10), " 3"
    and other scripts' digits, so a mistyped rank or count would silently name another."""
    if not isinstance(text, str):
        raise TypeError(f"parse_decimal takes the text to read, a str; got {short_repr(text)}")
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()) or len(digits) > MAX_DECIMAL_DIGITS:
        return None
    return int(text)
