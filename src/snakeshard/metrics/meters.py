"""DanLing's meters (``AverageMeter``, ``AverageMeters``, ``MetricMeter``), merged by ``merge(states)``
instead of an all-reduce, so shard jobs that never talk to each other can combine them.

``AverageMeter`` keeps ``val`` (the latest value), ``sum`` (of value x n) and ``count`` (of n) in float64,
scalars or fixed-shape arrays; ``avg = sum / count``. ``f"{meter:.4f}"`` gives ``"val (avg)"`` as DanLing
prints it. A merged meter's ``val`` is its ``avg``: across shards there is no "latest" value.
"""

from __future__ import annotations

import math
from typing import Callable

from snakeshard.metrics.state import MetricStateError, canonical, check_states


def _as_value(value):
    """A Python float for scalars; a float64 array (a copy) for arrays and tensors."""
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor: to host memory first
        value = value.detach().cpu().numpy()
    array = np.asarray(value, dtype=np.float64)
    return float(array) if array.ndim == 0 else array.copy()


def _to_json(value):
    return value.tolist() if hasattr(value, "tolist") else value


class AverageMeter:
    """Running average of values (scalars or arrays of one shape), weighted by ``n``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.val = math.nan
        self.sum = 0.0
        self.count = 0

    def update(self, value, n: int = 1) -> None:
        import numpy as np

        if n < 0:
            raise ValueError(f"AverageMeter.update: n={n}; a weight is a count of values, 0 or more")
        value = _as_value(value)
        if self.count and np.shape(value) != np.shape(self.sum):
            raise ValueError(f"AverageMeter: a value of shape {np.shape(value)}, earlier values "
                             f"{np.shape(self.sum)}: every update of a meter must have the same shape")
        self.val = value
        self.sum = self.sum + value * n
        self.count += n

    @property
    def avg(self):
        if not self.count:
            return math.nan
        return self.sum / self.count

    def state(self) -> dict:
        return {"type": "AverageMeter", "sum": _to_json(self.sum), "count": self.count}

    @classmethod
    def merge(cls, states) -> "AverageMeter":
        """One meter holding every state's values: sums and counts added (canonical order)."""
        import numpy as np

        meter = cls()
        states = check_states(cls, states)
        shapes = {np.shape(s["sum"]) for s in states if s["count"]}
        if len(shapes) > 1:
            raise MetricStateError(f"AverageMeter.merge: states of shapes {sorted(shapes)}: a meter holds one shape")
        for state in canonical(states):
            meter.sum = meter.sum + _as_value(state["sum"])
            meter.count += state["count"]
        meter.val = meter.avg
        return meter

    def __format__(self, spec: str) -> str:
        return f"{_format(self.val, spec)} ({_format(self.avg, spec)})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(val={self.val!r}, avg={self.avg!r}, count={self.count})"


def _format(value, spec: str) -> str:
    if hasattr(value, "shape"):
        return "[" + ", ".join(format(float(v), spec) for v in value.ravel()) + "]"
    return format(value, spec)


class MetricMeter(AverageMeter):
    """``metric_fn(input, target)`` per batch, averaged over batches **weighted by batch size**.

    Exact for metrics that are means over items (accuracy, MSE, a mean loss): the weighted mean of
    per-batch means is the mean over all items. Not for metrics that are not such means (F1, AUROC,
    WER as a ratio of sums): use the corpus metrics (``ErrorRate``, ``ConfusionMatrix``, ``BinaryScores``).
    """

    def __init__(self, metric_fn: Callable):
        super().__init__()
        self.metric = metric_fn

    def update(self, input, target, n: int | None = None) -> None:  # noqa: A002 -- DanLing's names
        value = self.metric(input, target)
        super().update(value, len(input) if n is None else n)

    def state(self) -> dict:
        return {**super().state(), "type": "MetricMeter"}

    @classmethod
    def merge(cls, states, metric_fn: Callable | None = None) -> "MetricMeter":
        merged = AverageMeter.merge([{**s, "type": "AverageMeter"} for s in check_states(cls, states)])
        meter = cls(metric_fn)
        meter.sum, meter.count, meter.val = merged.sum, merged.count, merged.val
        return meter


class AverageMeters:
    """Several named ``AverageMeter``s.

    As DanLing's: ``AverageMeters()`` starts a meter on a name's first use (``update(loss=0.3, n=8)``,
    ``update({"loss": 0.3})``, ``meters["loss"]``, ``meters.loss``). With names declared up front,
    ``AverageMeters("loss", "acc")``, another name is a ``KeyError`` (a typo never starts a meter of its
    own), and so is reading one. A name that is also an attribute of this class (``avg``, ``sum``, ``count``,
    ``val``, ``update``, ...) is read as ``meters["avg"]``.
    """

    def __init__(self, *names: str, **meters: AverageMeter):
        self._meters = {name: AverageMeter() for name in names}
        self._meters.update(meters)
        self._declared = bool(self._meters)  # declared names: no other meter starts

    @classmethod
    def _of(cls, meters: dict) -> "AverageMeters":
        made = cls()
        made._meters = dict(meters)  # any name, "self" included
        made._declared = True
        return made

    def __getitem__(self, name: str) -> AverageMeter:
        try:
            return self._meters[name]
        except KeyError:
            if self._declared:
                raise KeyError(f"no meter {name!r} (declared: {sorted(self._meters)})") from None
        meter = self._meters[name] = AverageMeter()
        return meter

    def __getattr__(self, name: str) -> AverageMeter:
        # only for names that are no attribute of the object: meters.loss
        if name.startswith("_"):  # copy, pickle and other protocols probe dunder and private names
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(e.args[0]) from None

    def __contains__(self, name: str) -> bool:
        return name in self._meters

    def __iter__(self):
        return iter(self._meters)

    def keys(self):
        return self._meters.keys()

    def update(self, values: dict | None = None, *, n: int = 1, **kw) -> None:
        values = {**(values or {}), **kw}
        if self._declared:
            for name in values:
                self[name]  # every name checked first: a typo updates nothing
        for name, value in values.items():
            self[name].update(value, n)

    def reset(self) -> None:
        for meter in self._meters.values():
            meter.reset()

    @property
    def val(self) -> dict:
        return {name: m.val for name, m in self._meters.items()}

    @property
    def avg(self) -> dict:
        return {name: m.avg for name, m in self._meters.items()}

    @property
    def sum(self) -> dict:
        return {name: m.sum for name, m in self._meters.items()}

    @property
    def count(self) -> dict:
        return {name: m.count for name, m in self._meters.items()}

    def state(self) -> dict:
        return {"type": "AverageMeters", "meters": {name: m.state() for name, m in self._meters.items()}}

    @classmethod
    def merge(cls, states) -> "AverageMeters":
        """The meters of all states, each merged from the states that hold it: shards may have started their
        meters in any order, and a shard without a name's values has no meter of it (a meter it holds empty
        adds nothing). The merged object holds those names only."""
        states = check_states(cls, states)
        names = list(dict.fromkeys(name for s in canonical(states) for name in s["meters"]))  # any states' order
        return cls._of({name: AverageMeter.merge([s["meters"][name] for s in states if name in s["meters"]])
                        for name in names})

    def __format__(self, spec: str) -> str:
        return "\t".join(f"{name}: {meter:{spec}}" for name, meter in self._meters.items())
