"""What every meter and metric shares: a JSON-safe ``state()`` and a ``merge(states)`` that is
associative and independent of the order of the states.

Two kinds of merge (``Metric.merge_kind``):

* ``additive``: the state is a set of sums (counts, float64 sums, a confusion matrix); merging adds
  them. Integer counts merge exactly; float64 sums merge to rounding (<= 1e-12 relative), and the
  states are added in a canonical order, so the same states give the same bits in any order.
* ``all-data``: the metric needs every prediction at once (AUROC, EER); its state holds them, merging
  unites them (a key seen twice is an error), and the value is computed once, over all of them.
"""

from __future__ import annotations

import json
import math

from snakeshard.errors import SnakeshardError


class MetricStateError(SnakeshardError, ValueError):
    """A state that cannot be merged: another metric's, another version, another configuration."""


def canonical(states: list[dict]) -> list[dict]:
    """``states`` in an order that does not depend on how they were given (float sums then round alike)."""
    return sorted(states, key=lambda s: json.dumps(s, sort_keys=True))


def check_states(cls, states, same: tuple = ()) -> list[dict]:
    """The states, after checking each is one of ``cls`` and agrees with the first on the ``same`` fields."""
    states = list(states)
    if not states:
        raise MetricStateError(f"{cls.__name__}.merge: no states to merge")
    for n, state in enumerate(states):
        if not isinstance(state, dict) or state.get("type") != cls.__name__:
            got = state.get("type") if isinstance(state, dict) else type(state).__name__
            raise MetricStateError(f"{cls.__name__}.merge: state {n} is a {got!r} state, not a {cls.__name__!r} one")
        for field in same:
            if state.get(field) != states[0].get(field):
                raise MetricStateError(f"{cls.__name__}.merge: state {n} has {field} {state.get(field)!r}, "
                                       f"state 0 {states[0].get(field)!r}: they measure different things")
    return states


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when there is nothing to divide by (no data is not a score of 0)."""
    return numerator / denominator if denominator else math.nan


class Metric:
    """Base of the corpus metrics: ``update`` accumulates, ``compute()`` gives ``{name: value}``,
    ``state()`` the JSON-safe sufficient statistics, ``merge(states)`` a metric holding their union."""

    merge_kind = "additive"

    def state(self) -> dict:
        raise NotImplementedError

    @classmethod
    def merge(cls, states):
        raise NotImplementedError

    def compute(self) -> dict:
        raise NotImplementedError
