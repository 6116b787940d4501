"""Classification metrics from a confusion matrix: the matrix is the sufficient statistic.

Labels are strings (as text fields hold them). Merging adds the matrices over the union of labels, so
accuracy, balanced accuracy and precision/recall/F1 (per class, macro, micro, weighted by support) are
exact for any sharding. A class with no prediction has precision 0 and one with no reference recall 0
(scikit-learn's ``zero_division=0``); balanced accuracy averages recall over classes that occur in the
references, as scikit-learn does.
"""

from __future__ import annotations

import re

from snakeshard.metrics.state import Metric, check_states, ratio


class ConfusionMatrix(Metric):
    name = "classification"

    def __init__(self):
        self.counts: dict[tuple[str, str], int] = {}  # (reference, prediction) -> count

    def update(self, references, predictions) -> None:
        if len(references) != len(predictions):
            raise ValueError(f"ConfusionMatrix.update: {len(references)} references but {len(predictions)} predictions")
        for ref, pred in zip(references, predictions):
            pair = (str(ref), str(pred))
            self.counts[pair] = self.counts.get(pair, 0) + 1

    @property
    def labels(self) -> list[str]:
        return sorted({label for pair in self.counts for label in pair}, key=_natural)

    def matrix(self) -> list[list[int]]:
        """Rows: reference label, columns: predicted label, both in ``labels`` order."""
        labels = self.labels
        return [[self.counts.get((r, p), 0) for p in labels] for r in labels]

    def state(self) -> dict:
        return {"type": "ConfusionMatrix", "labels": self.labels, "matrix": self.matrix()}

    @classmethod
    def merge(cls, states):
        merged = cls()
        for state in check_states(cls, states):
            labels = state["labels"]
            for r, row in zip(labels, state["matrix"]):
                for p, n in zip(labels, row):
                    if n:
                        merged.counts[r, p] = merged.counts.get((r, p), 0) + n
        return merged

    def compute(self) -> dict:
        labels = self.labels
        total = sum(self.counts.values())
        support = {c: sum(n for (r, _), n in self.counts.items() if r == c) for c in labels}
        predicted = {c: sum(n for (_, p), n in self.counts.items() if p == c) for c in labels}
        correct = {c: self.counts.get((c, c), 0) for c in labels}
        per_class = {}
        for c in labels:
            precision = ratio(correct[c], predicted[c]) if predicted[c] else 0.0
            recall = ratio(correct[c], support[c]) if support[c] else 0.0
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
            per_class[c] = {"precision": precision, "recall": recall, "f1": f1, "support": support[c]}
        present = [c for c in labels if support[c]]
        accuracy = ratio(sum(correct.values()), total)
        out = {"accuracy": accuracy, "items": total,
               "balanced_accuracy": ratio(sum(per_class[c]["recall"] for c in present), len(present))}
        for what in ("precision", "recall", "f1"):
            out[f"{what}_macro"] = ratio(sum(per_class[c][what] for c in labels), len(labels))
            out[f"{what}_weighted"] = ratio(sum(per_class[c][what] * support[c] for c in labels), total)
            out[f"{what}_micro"] = accuracy  # single-label: every error is one false positive and one false negative
        out["per_class"] = per_class
        return out


def _natural(label: str) -> list:
    """Labels in natural order: digit runs compare as numbers ("9" before "10", "spk2" before "spk10")."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", label) if part]
