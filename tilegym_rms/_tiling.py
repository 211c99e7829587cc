"""Integer helpers the launch heuristics of every backend share (tile shapes are powers of two)."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= ``n`` (1 for n <= 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)
