"""Metrics that need every score at once: AUROC, AUPRC (average precision), EER and minDCF.

None of them is a mean over items, so none can be averaged across shards (a weighted mean of
per-shard AUROCs is not the AUROC). Their state is the data itself, ``{key: [score, label]}``;
merging unites the states (a key in two of them is an error) and the value is computed once, over
every key. Labels are 1 (target / positive) or 0.

* AUROC: the probability that a random positive scores above a random negative, ties counting half
  (Mann-Whitney U from average ranks).
* AUPRC: average precision, ``sum_n (R_n - R_{n-1}) P_n`` over the distinct score thresholds, high to
  low (scikit-learn's ``average_precision_score``; no interpolation).
* EER: where the miss rate (1 - TPR) equals the false-alarm rate on the ROC, linearly interpolated
  between the two operating points (distinct thresholds) around the crossing.
* minDCF: ``min_t (c_miss P_miss(t) p_target + c_fa P_fa(t) (1 - p_target)) / min(c_miss p_target,
  c_fa (1 - p_target))`` over every threshold, NIST's normalized detection cost (p_target 0.01 and
  costs 1 by default, as VoxCeleb reports it).
"""

from __future__ import annotations

from snakeshard.metrics.state import Metric, MetricStateError, check_states

ALL_DATA = "all-data"


class BinaryScores(Metric):
    merge_kind = ALL_DATA

    def __init__(self, *, p_target: float = 0.01, c_miss: float = 1.0, c_fa: float = 1.0):
        self.scores: dict[str, tuple[float, int]] = {}
        self.dcf = {"p_target": p_target, "c_miss": c_miss, "c_fa": c_fa}

    def update(self, keys, scores, labels) -> None:
        import math

        for key, score, label in zip(keys, scores, labels, strict=True):
            key = str(key)  # as a JSON state holds it: 1 and "1" are one key
            if key in self.scores:
                raise MetricStateError(f"BinaryScores: key {key!r} scored twice")
            if label not in (0, 1):  # 0.5 must not truncate to 0; True/False and 1.0/0.0 are fine
                raise ValueError(f"BinaryScores: key {key!r} has label {label!r}; labels are 1 (target) or 0")
            score = float(score)
            if not math.isfinite(score):
                raise ValueError(f"BinaryScores: key {key!r} has score {score}; scores must be finite to rank")
            self.scores[key] = (score, int(label))

    def state(self) -> dict:
        return {"type": "BinaryScores", **self.dcf,
                "scores": {k: list(self.scores[k]) for k in sorted(self.scores)}}

    @classmethod
    def merge(cls, states):
        states = check_states(cls, states, same=("p_target", "c_miss", "c_fa"))
        merged = cls(p_target=states[0]["p_target"], c_miss=states[0]["c_miss"], c_fa=states[0]["c_fa"])
        for state in states:
            for key, (score, label) in state["scores"].items():
                if key in merged.scores:
                    raise MetricStateError(f"BinaryScores.merge: key {key!r} is in two states (two shards scored it)")
                merged.scores[key] = (score, label)
        return merged

    def _curve(self):
        """(scores, labels) sorted by score, high first; per distinct threshold the cumulative true and
        false positives; positives, negatives."""
        import numpy as np

        keys = sorted(self.scores)  # a fixed order: ties are then broken alike whatever the sharding
        scores = np.array([self.scores[k][0] for k in keys], dtype=np.float64)
        labels = np.array([self.scores[k][1] for k in keys], dtype=np.int64)
        order = np.argsort(-scores, kind="stable")
        scores, labels = scores[order], labels[order]
        last_of_threshold = np.r_[np.nonzero(np.diff(scores))[0], len(scores) - 1]
        tps = np.cumsum(labels)[last_of_threshold]
        fps = (last_of_threshold + 1) - tps
        return scores, labels, tps, fps, int(labels.sum()), int(len(labels) - labels.sum())

    def compute(self) -> dict:
        import numpy as np

        nan = float("nan")
        if not self.scores or len({label for _, label in self.scores.values()}) < 2:
            # every metric here compares targets with non-targets
            pos = sum(label for _, label in self.scores.values())
            return {"items": len(self.scores), "positives": pos, "negatives": len(self.scores) - pos,
                    "auroc": nan, "auprc": nan, "eer": nan, "min_dcf": nan, **self.dcf}
        scores, labels, tps, fps, pos, neg = self._curve()
        out = {"items": len(scores), "positives": pos, "negatives": neg}
        # AUROC: Mann-Whitney U with average ranks (ascending scores; ties share their mean rank)
        ascending = scores[::-1]
        _, first, counts = np.unique(ascending, return_index=True, return_counts=True)
        mean_rank = first + (counts + 1) / 2.0
        ranks = np.repeat(mean_rank, counts)
        positive_ranks = ranks[labels[::-1] == 1].sum()
        out["auroc"] = float((positive_ranks - pos * (pos + 1) / 2.0) / (pos * neg))
        # AUPRC: average precision over distinct thresholds
        recall = tps / pos
        precision = tps / (tps + fps)
        out["auprc"] = float(np.sum(np.diff(np.r_[0.0, recall]) * precision))
        # EER: operating points from "accept nothing" to "accept all"
        fpr = np.r_[0.0, fps / neg]
        fnr = np.r_[1.0, 1.0 - tps / pos]
        i = int(np.argmax(fnr <= fpr))  # first point where misses no longer exceed false alarms
        gap_before, gap_at = fnr[i - 1] - fpr[i - 1], fnr[i] - fpr[i]
        share = gap_before / (gap_before - gap_at) if gap_before != gap_at else 0.0
        out["eer"] = float(fpr[i - 1] + share * (fpr[i] - fpr[i - 1]))
        # minDCF over the same operating points
        p, c_miss, c_fa = self.dcf["p_target"], self.dcf["c_miss"], self.dcf["c_fa"]
        cost = c_miss * fnr * p + c_fa * fpr * (1 - p)
        out["min_dcf"] = float(cost.min() / min(c_miss * p, c_fa * (1 - p)))
        out.update(self.dcf)
        return out
