"""Shape buckets: the executor pads a step's token and logits rows to a power of two so that a bounded set of
shapes is compiled; the predictor and the profiling tools cost steps at the same padded sizes (no jax)."""
from __future__ import annotations


def bucket(n: int, minimum: int) -> int:
    """`n` rounded up to a power of two, at least `minimum`; `minimum` <= 0: no padding (n itself)."""
    if minimum <= 0:
        return n
    return max(minimum, 1 << max(n - 1, 0).bit_length())
