"""Tools and an environment for the agentic tests, in TRL's conventions: type hints, Google-style
docstrings; one that fails, one that takes its time (sync and async), and a counter environment."""
from __future__ import annotations

import asyncio
import time


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("the tool broke")


def slow(x: int) -> int:
    """Takes its time (3 s).

    Args:
        x: ignored
    """
    time.sleep(3.0)
    return x


async def slow_async(x: int) -> int:
    """Takes its time (3 s) without a thread.

    Args:
        x: ignored
    """
    await asyncio.sleep(3.0)
    return x


class Counter:
    """An environment: a counter per rollout, its value the episode's reward; reset() tells the model
    where it starts and keeps the row's answers it saw (`resets`)."""
    resets: list = []

    def reset(self, **row):
        self.count = 0
        Counter.resets.append(row.get("answer"))
        return f" (start from {row.get('answer')})"

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def crash() -> int:
    """Ends its process (as a C extension's abort would).
    """
    import os

    os._exit(3)


def segfault() -> int:
    """Reads address 0.
    """
    import ctypes

    return ctypes.string_at(0)
