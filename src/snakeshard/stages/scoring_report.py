"""What a person reads of a scoring stage: ``metrics.txt`` (sclite-like) and ``metrics.png``."""

from __future__ import annotations

import math
from pathlib import Path

from snakeshard.metrics.text import summary_line
from snakeshard.stages.scoring_fields import TEXT_METRICS, binary_label, merged_pairs


def _number(x, digits: int = 4) -> str:
    """A metric's value as printed; undefined on the data (NaN, or null in metrics.json) says so; a value too small
    for ``digits`` decimals in 4 significant digits (an MSE of 1.2e-8 printed as 0.0000: a user trial)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "undefined"
    return f"{x:.3e}" if x and abs(x) < 10 ** -(digits - 1) else f"{x:.{digits}f}"


def _percent(x) -> float:
    """An error rate for a bar: NaN where metrics.json holds null (no reference words)."""
    return math.nan if x is None else 100 * x


def metrics_text(record: dict) -> str:
    scoring, metrics = record["scoring"], record["metrics"]
    lines = []
    for name in scoring["metrics"]:
        value = metrics[name]["value"]
        if name in TEXT_METRICS:
            lines.append(summary_line(name, value))
        elif name == "classification":
            lines.append(f"accuracy {_number(value['accuracy'])}, balanced accuracy {_number(value['balanced_accuracy'])}, "
                         f"F1 macro {_number(value['f1_macro'])} / weighted {_number(value['f1_weighted'])} "
                         f"({value['items']} items, {len(value['per_class'])} classes)")
        elif name == "regression":
            lines.append(", ".join(f"{m.upper()} {_number(value[m])}" for m in ("mse", "rmse", "mae")) +
                         f", Pearson {_number(value['pearson'])}, R2 {_number(value['r2'])} ({value['items']} items)")
        else:
            lines.append(f"{name.upper() if name != 'min_dcf' else 'minDCF'} {_number(value[name])} "
                         f"({value['positives']} targets, {value['negatives']} non-targets)")
    normalize = scoring["normalize"]
    lines += ["", f"hypothesis: field {scoring['hypothesis']!r}; reference: field {scoring['reference']!r}"]
    if normalize is not None:
        lines.append("normalization (jiwer, both sides): " + (", ".join(normalize) if normalize else
                                                                "none (scored as written, split on whitespace)"))
    empty = max((metrics[m]["value"]["empty_references"] for m in TEXT_METRICS if m in metrics), default=0)
    if empty:
        lines.append(f"{empty} utterance(s) with an empty reference: scored as jiwer does (each hypothesis word is "
                     "an insertion; counted in the totals above)")
    for name in (m for m in scoring["metrics"] if m in TEXT_METRICS):
        if record["groups"]:
            lines += ["", *_group_table(name, scoring["group_by"], record["groups"], metrics[name]["value"])]
    if "classification" in metrics:
        lines += ["", *_per_class_table(metrics["classification"]["value"]["per_class"])]
        if record["groups"]:
            lines += ["", *_accuracy_per_group(scoring["group_by"], record["groups"], metrics["classification"]["value"])]
    if "regression" in metrics and record["groups"]:
        lines += ["", *_regression_per_group(scoring["group_by"], record["groups"], metrics["regression"]["value"])]
    lines.append("")
    return "\n".join(lines)


def _group_table(name: str, by: str, groups: dict, total: dict) -> list[str]:
    """sclite's per-speaker summary: counts and percentages of the reference length."""
    width = max(8, *(len(g) for g in groups))
    head = f"{by:<{width}} {'#utt':>6} {'#' + ('words' if name == 'wer' else 'chars'):>8} {'corr%':>7} {'sub%':>7} {'del%':>7} {'ins%':>7} {name + '%':>7}"
    rows = [f"{name.upper()} per {by}:", head, "-" * len(head)]

    def row(label, v):
        n = max(v["reference_length"], 1)
        return (f"{label:<{width}} {v['utterances']:>6} {v['reference_length']:>8} {100 * v['hits'] / n:>7.2f} "
                f"{100 * v['substitutions'] / n:>7.2f} {100 * v['deletions'] / n:>7.2f} "
                f"{100 * v['insertions'] / n:>7.2f} {100 * v[name]:>7.2f}")

    rows += [row(g, groups[g][name]["value"]) for g in groups]
    rows += ["-" * len(head), row("all", total)]
    return rows


def _accuracy_per_group(by: str, groups: dict, total: dict) -> list[str]:
    """Accuracy per group (per speaker with ``group_by: spk``), and over all."""
    width = max(8, *(len(g) for g in groups))
    head = f"{by:<{width}} {'items':>6} {'accuracy':>9} {'F1 macro':>9}"
    rows = [f"accuracy per {by}:", head, "-" * len(head)]
    values = [(g, groups[g]["classification"]["value"]) for g in groups] + [("all", total)]
    rows += [f"{g:<{width}} {v['items']:>6} {v['accuracy']:>9.4f} {v['f1_macro']:>9.4f}" for g, v in values]
    rows.insert(-1, "-" * len(head))
    return rows


def _regression_per_group(by: str, groups: dict, total: dict) -> list[str]:
    """MSE, MAE and R2 per group, and over all."""
    width = max(8, *(len(g) for g in groups))
    head = f"{by:<{width}} {'items':>6} {'MSE':>10} {'MAE':>10} {'R2':>10}"
    rows = [f"regression per {by}:", head, "-" * len(head)]
    values = [(g, groups[g]["regression"]["value"]) for g in groups] + [("all", total)]
    rows += [f"{g:<{width}} {v['items']:>6} {_number(v['mse']):>10} {_number(v['mae']):>10} {_number(v['r2']):>10}"
             for g, v in values]
    rows.insert(-1, "-" * len(head))
    return rows


def _per_class_table(per_class: dict) -> list[str]:
    width = max(8, *(len(c) for c in per_class))
    rows = [f"{'class':<{width}} {'precision':>9} {'recall':>9} {'f1':>9} {'support':>8}"]
    rows += [f"{c:<{width}} {v['precision']:>9.4f} {v['recall']:>9.4f} {v['f1']:>9.4f} {v['support']:>8}"
             for c, v in per_class.items()]
    return rows


def plot_metrics(record: dict, set_dir: Path, path: Path) -> None:
    """One PNG with a panel per view: error rate per group (or overall), the confusion matrix, the ROC."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    from snakeshard.io.atomic import atomic_write_bytes

    scoring, metrics = record["scoring"], record["metrics"]
    panels = [m for m in scoring["metrics"] if m in TEXT_METRICS][:1]
    panels += [p for p in ("classification",) if p in metrics]
    panels += ["roc"] if any(m in metrics for m in ("auroc", "auprc", "eer", "min_dcf")) else []
    panels += [p for p in ("regression",) if p in metrics]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel in TEXT_METRICS:
            _error_rate_panel(ax, panel, record)
        elif panel == "classification":
            _confusion_panel(ax, metrics["classification"]["value"], record)
        elif panel == "roc":
            _roc_panel(ax, set_dir, metrics)
        else:
            _scatter_panel(ax, set_dir, metrics["regression"]["value"])
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})  # no version stamp: same bytes on rerun
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _error_rate_panel(ax, name: str, record: dict) -> None:
    groups = record["groups"]
    labels = list(groups) or ["all"]
    overall = _percent(record["metrics"][name]["value"][name])
    values = [_percent(groups[g][name]["value"][name]) for g in groups] or [overall]
    ax.bar(labels, values, color="#4c72b0")
    ax.axhline(overall, color="#c44e52", linestyle="--", label=f"all: {overall:.2f}%")
    ax.set_ylabel(f"{name.upper()} (%)")
    ax.set_title(f"{name.upper()} per {record['scoring']['group_by']}" if groups else name.upper())
    ax.legend()
    ax.tick_params(axis="x", rotation=45)


def _confusion_panel(ax, value: dict, record: dict) -> None:
    state = record["metrics"]["classification"]["state"]
    labels, matrix = state["labels"], state["matrix"]
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=45)
    ax.set_yticks(range(len(labels)), labels)
    for i, row in enumerate(matrix):
        for j, n in enumerate(row):
            ax.text(j, i, str(n), ha="center", va="center")
    ax.set_xlabel("prediction")
    ax.set_ylabel("reference")
    ax.set_title(f"confusion matrix (accuracy {_number(value['accuracy'])})")


def _roc_panel(ax, set_dir: Path, metrics: dict) -> None:
    import numpy as np

    pairs = merged_pairs(set_dir)
    scores = np.array([float(p) for _, p, _ in pairs])
    labels = np.array([binary_label(k, t) for k, _, t in pairs])
    order = np.argsort(-scores, kind="stable")
    tpr = np.r_[0, np.cumsum(labels[order]) / max(labels.sum(), 1)]
    fpr = np.r_[0, np.cumsum(1 - labels[order]) / max((1 - labels).sum(), 1)]
    ax.plot(fpr, tpr, color="#4c72b0")
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":")
    title = ", ".join(f"{m.upper()} {_number(metrics[m]['value'][m])}" for m in ("auroc", "eer") if m in metrics)
    ax.set_title(f"ROC ({title})" if title else "ROC")
    ax.set_xlabel("false alarm rate")
    ax.set_ylabel("hit rate")


def _scatter_panel(ax, set_dir: Path, value: dict) -> None:
    pairs = merged_pairs(set_dir)
    ax.scatter([float(t) for _, _, t in pairs], [float(p) for _, p, _ in pairs], s=8)
    ax.set_xlabel("target")
    ax.set_ylabel("prediction")
    ax.set_title(f"regression (R2 {_number(value['r2'])}, Pearson {_number(value['pearson'])})")
