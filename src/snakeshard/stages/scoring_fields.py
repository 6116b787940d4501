"""What the scoring stage (scoring.py) and its report (scoring_report.py) both read: the metric families, the
reference labels of binary scores, and the merged (key, prediction, target) pairs."""

from __future__ import annotations

from pathlib import Path

from snakeshard.errors import DataError

TEXT_METRICS = ("wer", "cer")
POSITIVE, NEGATIVE = frozenset({"1", "target", "true"}), frozenset({"0", "nontarget", "false"})


def binary_label(key: str, value) -> int:
    """A binary reference label: 1 for a target, 0 for a non-target, else an error naming the key."""
    text = str(value).strip().lower()
    if text in POSITIVE:
        return 1
    if text in NEGATIVE:
        return 0
    raise DataError(f"item {key!r}: reference label {value!r} is neither a target (1, target, true) nor a "
                    "non-target (0, nontarget, false)")


def merged_pairs(set_dir: Path) -> list[tuple[str, str, str]]:
    """(key, prediction, target) in plan order, from the merged fields (both come from the same results, and
    the merge checked each holds every key once)."""
    from snakeshard.stages.wer import read_text_table

    predictions, targets = read_text_table(set_dir / "prediction"), read_text_table(set_dir / "target")
    return [(key, prediction, targets[key]) for key, prediction in predictions.items()]
