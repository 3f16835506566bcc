"""Argument checks shared by colo's entry points, so the same mistake gets the same message everywhere."""
from __future__ import annotations


def int_kind(minimum: int) -> str:
    """How the messages name an integer no smaller than `minimum`."""
    return {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")


def check_int(value, name: str, minimum: int = 1) -> int:
    """`value` if it is an int (not a bool) no smaller than `minimum`; else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be {int_kind(minimum)}, got {value!r}")
    return value
