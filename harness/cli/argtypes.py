"""argparse ``type=`` converters for bounded numbers, so a bad flag fails at parse time with exit 2 and a
message naming the flag and what is allowed (argparse adds the flag name), instead of being silently replaced
by a default or failing deep inside a simulator."""

from __future__ import annotations

import argparse
from typing import Callable


def _bounded(kind: type, low: float, inclusive: bool, high: float | None = None) -> Callable[[str], float | int]:
    allowed = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:,}" if high is not None else "")

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}; "
                                             f"allowed: {allowed}") from None
        if (value < low if inclusive else value <= low) or (high is not None and value > high) or value != value:
            raise argparse.ArgumentTypeError(f"got {text}; allowed: {allowed}")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


positive_int = _bounded(int, 0, inclusive=False)
positive_float = _bounded(float, 0.0, inclusive=False)
non_negative_float = _bounded(float, 0.0, inclusive=True)
# KV block sizes: vLLM accepts powers of two up to a few hundred tokens; 1 Mi tokens bounds memory of the
# ideal-hit and simulator hash tables (10**12 would allocate terabytes).
block_size = _bounded(int, 1, inclusive=True, high=1 << 20)
# vLLM's num_gpu_blocks counts the reserved null block, so at least 2.
num_gpu_blocks = _bounded(int, 2, inclusive=True)
