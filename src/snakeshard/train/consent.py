"""``snakeshard continue STAGE``: the user's consent to resume an unfinished training run under a changed config
or code, instead of the refusal (or the ``rm -r`` that starts over).

A resume is refused when the newest checkpoint was written under another config, code or data: its steps are not
the ones the config now computes. After a bug fix in an ``evaluate_step``, a logging change or a new learning rate
for the rest of the run, a researcher wants those steps anyway (a trial's PyTorch researcher lost an epoch to each
such fix). The consent is written to ``<run dir>/continued.json``: one entry per consent, from the checkpoint's
fingerprint to the one the config has now, with the step and what differed. The training job then resumes that
checkpoint as this config's (``train(..., accepted=...)``), logs it, and keeps it in the run's record (``metrics.json``'s
``continued``), so a model trained across a change says so. A later edit makes another fingerprint: it is refused
again until consented to again.

Not consented to: another data set (``sets.*``: the epochs' batch orders are over the keys) or another number of
ranks (each rank's RNG states are in the checkpoint). A finished run is no run to continue: a new config trains
a new model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from snakeshard.errors import SnakeshardError

CONTINUED = "continued.json"


def consented(run_dir: str | Path, fingerprint: str) -> dict[str, str]:
    """{checkpoint fingerprint: reason} of each consent in ``run_dir`` to resume under ``fingerprint``."""
    return {entry["from"]: f"`snakeshard continue` accepted it at step {entry['step']} ({entry['differs']})"
            for entry in _entries(Path(run_dir)) if entry["to"] == fingerprint}


def _entries(run_dir: Path) -> list[dict]:
    path = run_dir / CONTINUED
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except ValueError as e:
        raise SnakeshardError(f"{path} does not read as JSON ({e}): delete it and run snakeshard continue again") from None


def refusal_of_consent(diff: list[str]) -> str | None:
    """Why ``snakeshard continue`` cannot accept this difference (config_diff's lines), or None when it can."""
    data = [d.split(" ", 1)[0] for d in diff if d.startswith("sets.")]
    if data:
        return (f"the data differs ({', '.join(data)}): a run's batch orders are over its keys, so its steps go on "
                "over the data they were written with only")
    if any(d.startswith("ranks:") for d in diff):
        return "the number of ranks differs: the checkpoint holds each rank's RNG states"
    return None


def record_consent(run_dir: str | Path, stage: str, fingerprint: str, refused) -> str:
    """Write the consent to resume the checkpoint the next run would refuse (``refused``: loop.next_run's answer)
    under ``fingerprint`` (the config and code now); returns what was done, in one line. Raises when the change
    cannot be accepted."""
    from snakeshard.io.atomic import atomic_write_text

    run_dir, checkpoint = Path(run_dir), refused.refused_checkpoint
    why_not = refusal_of_consent(refused.refused_diff)
    if why_not:
        raise SnakeshardError(f"stages.{stage}: {checkpoint['path']} cannot be continued under this config: {why_not}")
    entries = _entries(run_dir) + [{"from": checkpoint["fingerprint"], "to": fingerprint, "step": checkpoint["step"],
                                    "differs": refused.differs, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
    atomic_write_text(run_dir / CONTINUED, json.dumps(entries, indent=1) + "\n")
    return (f"stage {stage}: the next run resumes from {checkpoint['path']} (step {checkpoint['step']}) under the "
            f"config and code as they are now ({refused.differs}); recorded in {run_dir / CONTINUED}")
