"""ExactSum: the correctly rounded sum, whatever the grouping (what makes collect-stats layout-independent)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from snakeshard.stages.exact_sum import ExactSum


def values() -> np.ndarray:
    """3,000 rows of 5 values over e**-200..e**200, both signs, plus a subnormal and +-1e300."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 5)) * np.exp(rng.uniform(-200, 200, (3000, 5)))
    x[0, 0], x[1, 1], x[2, 1] = 5e-324, -1e300, 1e300
    return x


@pytest.mark.parametrize("parts", [1, 3, 7, 50])
def test_any_partition_gives_the_correctly_rounded_sum(parts):
    """Split into ``parts`` shards at random, each added row by row and as a block, through state() and
    merge: bit for bit math.fsum's correctly rounded sum; a float64 running sum is not."""
    x = values()
    want = np.array([math.fsum(x[:, d]) for d in range(5)])
    rng = np.random.default_rng(parts)
    cuts = sorted(rng.choice(np.arange(1, len(x)), parts - 1, replace=False))
    total = ExactSum(5)
    for chunk in np.split(x, cuts):
        shard = ExactSum(5)
        for row in chunk[:700]:
            shard.add(row)
        shard.add(chunk[700:])
        total.merge(ExactSum.from_state(shard.state(), 5))
    assert total.value().tobytes() == want.tobytes()
    assert x.sum(0).tobytes() != want.tobytes()  # the data is hard enough that plain float64 rounding shows


def test_arrays_keep_their_shape_and_a_state_of_another_shape_is_refused():
    total = ExactSum((2, 3))
    total.add(np.ones((2, 3)))
    total.add(np.full((4, 2, 3), 0.5))
    assert total.value().shape == (2, 3) and (total.value() == 3.0).all()
    with pytest.raises(ValueError, match=r"a state of 6 elements is not a sum of shape \(4,\)"):
        ExactSum.from_state(total.state(), 4)
    with pytest.raises(ValueError, match=r"cannot add sums of shape \(6,\) to shape \(2, 3\)"):
        total.merge(ExactSum(6))
