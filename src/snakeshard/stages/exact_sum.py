"""Exact sums of float64 vectors, so a sum over shards does not depend on where the shards were cut.

A float64 running sum rounds at every addition, so ``(a + b) + c`` and ``a + (b + c)`` can differ in the
last bit: statistics summed per shard and then across shards would change with the shard count.
``ExactSum`` keeps the sum exactly, as one integer per element in units of 2**-1126 (every float64 is an
integer multiple of that), and rounds once, correctly, when read. Any grouping of the same additions
gives the same integers, hence the same float64 result, bit for bit.

Adding is vectorised: rows are buffered, then each float64 is split into its 53-bit integer significand
and its exponent, and the significands are added into one int64 cell per (element, exponent); 512 values
below 2**53 cannot overflow a cell. The non-zero cells (the values of one feature dim span a handful of
exponents) are then shifted into the Python integers, 512 rows at a time.
"""

from __future__ import annotations

import math

import numpy as np

SIGNIFICAND_BITS = 53
MIN_EXPONENT = -1073  # np.frexp's exponent for the smallest subnormal (5e-324 = 0.5 * 2**-1073)
EXPONENTS = 1024 - MIN_EXPONENT + 1
SCALE_BITS = SIGNIFICAND_BITS - MIN_EXPONENT  # value = integer * 2**-SCALE_BITS
ROWS_PER_FOLD = 512  # 512 * 2**53 < 2**63


class ExactSum:
    """The exact sum of float64 arrays of one shape: ``add(rows)``, ``value()``, ``state()``/``from_state``."""

    def __init__(self, shape: int | tuple[int, ...]):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.width = math.prod(self.shape)
        self._totals = [0] * self.width  # exact, in units of 2**-SCALE_BITS
        self._rows: list[np.ndarray] = []  # added, not yet split into cells (one numpy pass per 512 rows)
        self._buffered = 0

    def add(self, rows) -> None:
        """Add one array of ``shape``, or each of a stack of them. Values must be finite."""
        rows = np.array(rows, dtype=np.float64).reshape(-1, self.width)  # a copy: the caller may reuse its array
        self._rows.append(rows)
        self._buffered += len(rows)
        if self._buffered >= ROWS_PER_FOLD:
            self._fold()

    def _fold(self) -> None:
        if not self._rows:
            return
        rows = np.concatenate(self._rows)
        self._rows, self._buffered = [], 0
        cells = np.zeros((self.width, EXPONENTS), dtype=np.int64)
        column = np.arange(self.width)
        for start in range(0, len(rows), ROWS_PER_FOLD):
            chunk = rows[start:start + ROWS_PER_FOLD]
            fraction, exponent = np.frexp(chunk)  # chunk = fraction * 2**exponent, 0.5 <= |fraction| < 1
            significand = np.ldexp(fraction, SIGNIFICAND_BITS).astype(np.int64)  # exact: 53 bits
            np.add.at(cells, (np.broadcast_to(column, chunk.shape), exponent - MIN_EXPONENT), significand)
            for dim, cell in zip(*np.nonzero(cells)):
                # significand * 2**(exponent - 53) in units of 2**-SCALE_BITS: a shift by the cell's index
                self._totals[dim] += int(cells[dim, cell]) << int(cell)
            cells[:] = 0

    def merge(self, other: "ExactSum") -> None:
        other._fold()
        if other.shape != self.shape:
            raise ValueError(f"cannot add sums of shape {other.shape} to shape {self.shape}")
        self._totals = [a + b for a, b in zip(self._totals, other._totals)]

    def value(self) -> np.ndarray:
        """The sum (of ``shape``), rounded once to float64 (an int / power-of-two division rounds correctly)."""
        self._fold()
        unit = 1 << SCALE_BITS
        return np.array([total / unit for total in self._totals], dtype=np.float64).reshape(self.shape)

    def state(self) -> list[str]:
        """JSON-safe: each element's exact integer, in hex."""
        self._fold()
        return [hex(total) for total in self._totals]

    @classmethod
    def from_state(cls, state: list[str], shape: int | tuple[int, ...]) -> "ExactSum":
        total = cls(shape)
        if total.width != len(state):
            raise ValueError(f"a state of {len(state)} elements is not a sum of shape {total.shape}")
        total._totals = [int(text, 16) for text in state]
        return total
