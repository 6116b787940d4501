"""What a finished training stage declares: model.pt, metrics.json, curve.png, then done (each written atomically).

* ``model.pt``: ``{"model": state_dict, ...}`` of the best checkpoint (``score``), else of the last step, with the
  step and epoch it comes from, the stage's fingerprint and the stats it was trained with;
* ``metrics.json``: per epoch, each split's meter values and states (sums and counts, which
  ``AverageMeters.merge`` combines exactly), and the best score; nothing in it depends on when or how often the run
  was interrupted, so an interrupted and resumed run writes the same bytes as an uninterrupted one;
* ``curve.png``: the train loss per step and each meter per epoch.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from snakeshard.errors import SnakeshardError
from snakeshard.io.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from snakeshard.train.checkpoint import UNREADABLE, read_checkpoint

MODEL, METRICS, CURVE, DONE = "model.pt", "metrics.json", "curve.png", "done"  # in the order they are written


def write_outputs(run_dir: Path, spec: dict, result) -> None:
    lines = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    epochs = [line for line in lines if "train" in line]
    source = _write_model(run_dir, spec, result)
    score = spec["loop"].get("score")
    # no fingerprint here (it is in done and model.pt): it takes in the audio files' mtimes, and metrics.json is
    # what two runs over the same data compare
    metrics = {"stage": spec["stage"], "steps": result.step,
               "epochs": result.epoch, "stopped_early": result.stopped_early, "model_from": source,
               "score": None if score is None else {**score, "best": result.best_score, "best_epoch": result.best_epoch},
               "per_epoch": epochs, "continued": result.continued}
    atomic_write_text(run_dir / METRICS, json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    draw_curve(lines, run_dir / CURVE, spec["stage"])
    atomic_write_json(run_dir / DONE, {"stage": spec["stage"], "fingerprint": spec["fingerprint"],
                                       "steps": result.step, "epochs": result.epoch, "best_score": result.best_score,
                                       "best_epoch": result.best_epoch, "stopped_early": result.stopped_early,
                                       "continued_at": [c["step"] for c in result.continued]})


def _write_model(run_dir: Path, spec: dict, result) -> str:
    """model.pt from best.pt (with a score) or the final checkpoint; returns which one."""
    import torch

    checkpoints = run_dir / "checkpoints"
    path = checkpoints / ("best.pt" if result.best_epoch is not None else "latest.pt")
    try:
        checkpoint = read_checkpoint(path)
    except UNREADABLE as e:
        raise SnakeshardError(f"{path} does not read ({type(e).__name__}: {e}); delete {checkpoints} to train "
                              "from the start") from e
    model = {"model": checkpoint["model"], "stage": spec["stage"], "fingerprint": spec["fingerprint"],
             "step": checkpoint["progress"]["step"], "epoch": checkpoint["progress"]["epoch"],
             "best_score": result.best_score, "stats": spec["stats"]["path"] if spec["stats"] else None,
             "versions": checkpoint.get("versions")}
    buf = io.BytesIO()
    torch.save(model, buf)
    atomic_write_bytes(run_dir / MODEL, buf.getvalue())
    return path.name


def draw_curve(lines: list[dict], path: Path, stage: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    steps = [line for line in lines if "lr" in line and "loss" in line]
    epochs = [line for line in lines if "train" in line]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([s["step"] for s in steps], [s["loss"] for s in steps], lw=0.8)
    left.set(xlabel="step", ylabel="train loss", title=f"{stage}: loss per step")
    for split, style in (("train", "--"), ("valid", "-")):
        names = [n for n in (epochs[0].get(split) or {}) if isinstance(epochs[0][split][n], (int, float))] if epochs else []
        for name in names:
            right.plot([e["epoch"] for e in epochs], [e[split][name] for e in epochs], style, marker="o", ms=3,
                       label=f"{split} {name}")
    right.set(xlabel="epoch", title="meters per epoch")
    if right.lines:
        right.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})  # no version stamp: same bytes on rerun
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
