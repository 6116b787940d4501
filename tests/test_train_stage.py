"""The training stage in real snakemake runs (tests/train_project.py: fbank -> stats -> train -> infer -> score).

What each bad input does is said in its test: a feature dimension the model does not take, keys without labels,
an empty train or valid set, a non-finite loss (with and without skip_nonfinite), a train_step without a loss, a stale
upstream merge, and config mistakes at parse. Kill -9, SIGTERM and a corrupted latest.pt between reruns end with
the weights, steps.jsonl and metrics.json of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import (copy_workflow, once_per_session, read_config, run_cli, run_snakemake, wait_for,
                      write_config)
from snakeshard.workflow.status import merged_line

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
import train_project  # noqa: E402

TRAINED = "results/train/feats_train"
TRAIN_TARGET = f"{TRAINED}/done"


def make_project(root: Path, **overrides) -> Path:
    wd = copy_workflow(root)
    train_project.write_tones(wd)
    (wd / "tones.py").write_text(train_project.MODULE)
    write(wd, train_project.config(**overrides))
    return wd


def write(wd: Path, config: dict) -> None:
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


PROVIDER_KEYS = ("threads", "step_delay", "no_rng_restore", "nan_on_key", "no_loss", "hidden", "lr", "num_mel_bins")


def set_training(wd: Path, **changes) -> dict:
    """Change the training stage's config (provider_config keys go under provider_config; None leaves a key out)."""
    config = yaml.safe_load((wd / "config/config.yaml").read_text())
    stage = config["stages"]["train"]
    for key, value in changes.items():
        where = stage["provider_config"] if key in PROVIDER_KEYS else stage
        if value is None:  # left out
            where.pop(key, None)
        else:
            where[key] = value
    write(wd, config)
    return config


def outputs(wd: Path) -> dict:
    trained = wd / TRAINED
    model = torch.load(trained / "model.pt", weights_only=False)
    return {"weights": model["model"], "steps": (trained / "steps.jsonl").read_bytes(),
            "metrics": (trained / "metrics.json").read_bytes()}


def assert_same_training(got: dict, want: dict) -> None:
    assert got["weights"].keys() == want["weights"].keys()
    for name in want["weights"]:
        assert torch.equal(got["weights"][name], want["weights"][name]), name
    assert got["steps"] == want["steps"]  # every step's loss, lr and accuracy
    assert got["metrics"] == want["metrics"]


def steps_done(wd: Path) -> int:
    log = wd / TRAINED / "steps.jsonl"
    return sum(1 for line in log.read_text().splitlines() if '"lr"' in line) if log.exists() else 0


def train_process(wd: Path):
    import psutil

    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmd = proc.info["cmdline"] or []
        if "train" in cmd and "--spec" in cmd and proc.info["cwd"] == str(wd):
            return proc
    return None


def interrupt_at(wd: Path, step: int, sig: int, before=None, group: bool = False,
                 twice: bool = False) -> subprocess.CompletedProcess:
    """Run the training target; once ``step`` steps are logged, call ``before()`` if given, send ``sig`` to the
    training job (``group``: to snakemake's whole process group, as a terminal's Ctrl-C does; ``twice``: to the
    job again 50 ms later, within the same step); wait for snakemake."""
    cmd = [sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2", TRAIN_TARGET]
    driver = subprocess.Popen(cmd, cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=group)
    try:
        wait_for(lambda: steps_done(wd) >= step or driver.poll() is not None, 180, f"step {step}")
        proc = train_process(wd)
        assert proc is not None and driver.poll() is None, "the training job ended before it could be interrupted"
        if before is not None:  # the job is stopped meanwhile: it is interrupted at the step it was at
            proc.suspend()
            before()
        if group:
            os.killpg(driver.pid, sig)
        else:
            proc.send_signal(sig)
        if twice:
            time.sleep(0.05)
            proc.send_signal(sig)
        if before is not None and sig != signal.SIGKILL:
            proc.resume()
        out, _ = driver.communicate(timeout=180)
    finally:
        if driver.poll() is None:
            driver.kill()
    return subprocess.CompletedProcess(cmd, driver.returncode, out, "")


def reference(tmp_path_factory, threads: int) -> dict:
    """An uninterrupted run's training outputs (per torch thread count), computed once per session (shared with
    tests/test_slurm.py)."""
    def compute(directory: Path) -> dict:
        wd = make_project(directory / "p")
        set_training(wd, threads=threads)
        result = run_snakemake(wd, TRAIN_TARGET)
        assert result.returncode == 0, result.stderr[-3000:]
        return outputs(wd)
    return once_per_session(tmp_path_factory, f"training_reference_{threads}_threads", compute)


def docs_example_project(root: Path) -> Path:
    """The project with docs/stages.md's training example as written: its tones.py, its train and infer stages."""
    from doc_blocks import doc_block

    wd = make_project(root)
    (wd / "tones.py").write_text(doc_block("docs/stages.md", "python", "# tones.py"))
    config = train_project.config()
    config["stages"].update(yaml.safe_load(doc_block("docs/stages.md", "yaml", "  train:")))
    write(wd, config)
    return wd


def test_train_infer_score_then_a_model_change_reruns_training_inference_and_scoring_only(tmp_path):
    """docs/stages.md's training example (its tones.py and its train and infer stages) as written, and its output."""
    from doc_blocks import doc_text

    wd = docs_example_project(tmp_path / "p")
    dry = run_snakemake(wd, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "train_train" in dry.stdout and "shard_infer" in dry.stdout
    result = run_snakemake(wd)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = wd / TRAINED
    spec = json.loads((trained / "train.json").read_text())
    done = json.loads((trained / "done").read_text())
    assert done["fingerprint"] == spec["fingerprint"] and done["steps"] == 48 and done["epochs"] == 4 and not done["stopped_early"]
    metrics = json.loads((trained / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["per_epoch"]] == [0, 1, 2, 3] and metrics["model_from"] == "best.pt"
    assert metrics["score"]["name"] == "acc" and metrics["score"]["best"] == max(e["score"] for e in metrics["per_epoch"])
    assert metrics["per_epoch"][0]["train_state"]["meters"]["loss"]["count"] == 96  # every train key once
    model = torch.load(trained / "model.pt", weights_only=False)
    assert model["epoch"] == metrics["score"]["best_epoch"] + 1 and model["stats"] == "results/stats/feats_train"
    assert (trained / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == ["best.pt", "history", "latest.pt"]
    log = (trained / "logs/train.log").read_text()
    assert "96 train keys, 24 valid keys" in log and "epoch 3 (step 48): train loss" in log
    # inference from the best weights, then its accuracy over the 24 test tones
    predicted = (wd / "results/infer/feats_test/label").read_text().splitlines()
    assert len(predicted) == 24
    scored = json.loads((wd / "results/score/predicted/metrics.json").read_text())
    assert scored["metrics"]["classification"]["value"]["accuracy"] >= 0.9

    assert "Nothing to be done" in run_snakemake(wd, "-n").stdout
    status = run_cli(wd, "status").stdout
    page = doc_text("docs/stages.md")
    start = page.index("```\n$ tail -2 results/train/feats_train/logs/train.log\n") + 4
    shown = page[start:page.index("```", start)].splitlines()
    assert shown[1:3] == log.splitlines()[-2:]
    assert shown[3] == "$ snakeshard status | grep training" and shown[4] in status.splitlines()
    assert "note:" not in status, status  # the training's sets' dirs are its own (a trial: valid's was "of no stage")
    # What status says of the inference and scoring after it when the model is not the current one (a user trial:
    # "merged: yes, current" while snakemake -n reran them): a loop option changed, and the training dir gone.
    epochs = read_config(wd)["stages"]["train"]["epochs"]
    set_training(wd, epochs=epochs + 1)
    status = run_cli(wd, "status").stdout
    assert [line for line in status.splitlines() if "merged:" in line][-2:] == [
        "  merged: " + merged_line("stale", wd, "", False)] * 2, status
    set_training(wd, epochs=epochs)
    shutil.move(trained, wd / "aside")
    status = run_cli(wd, "status").stdout
    assert [line for line in status.splitlines() if "merged:" in line][-2:] == [
        "  merged: yes, not current: snakemake makes it again (its model, training stage train, is pending)",
        "  merged: yes, not current: snakemake makes it again (it reads stage infer, dataset feats_test, which is "
        "made again)"], status
    shutil.rmtree(trained)  # what the status's parse wrote there (train.json)
    shutil.move(wd / "aside", trained)
    assert "Nothing to be done" in run_snakemake(wd, "-n").stdout
    assert run_cli(wd, "status").stdout.count("merged: yes, current") == status.count("merged: yes")
    first_model = (trained / "model.pt").read_bytes()
    first_steps = (trained / "steps.jsonl").read_bytes()
    score = read_config(wd)["stages"]["train"]["score"]
    set_training(wd, hidden=16, score={**score, "patience": 1})  # the model's config only (and a patience)
    dry = run_snakemake(wd, "-n")
    for rule in ("train_train", "shard_infer", "shard_score"):
        assert rule in dry.stdout
    for rule in ("shard_fbank", "shard_stats"):
        assert rule not in dry.stdout  # data, features and statistics are kept
    result = run_snakemake(wd)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (trained / "logs/train.log").read_text()
    assert "a finished run of another config or data (the config differs (score.patience: not set -> 1; provider_config.hidden: 32 -> 16)); it " \
           f"is set aside in {TRAINED}/previous" in log
    assert json.loads((trained / "done").read_text())["fingerprint"] != done["fingerprint"]
    assert torch.load(trained / "model.pt", weights_only=False)["model"]["0.weight"].shape == (16, 40)
    assert sorted(p.name for p in (trained / "previous").iterdir()) == ["checkpoints", "steps.jsonl"]
    # stopped by its patience: status says so (a user trial: it read like a run of all its epochs)
    early = json.loads((trained / "done").read_text())
    assert early["stopped_early"] is True and early["epochs"] < epochs, early
    assert (f"(training), dataset feats_train: done  {early['steps']} steps, {early['epochs']} epochs (stopped early "
            "by score.patience), best score ") in run_cli(wd, "status").stdout
    # Back to the first config (a reverted edit; a user trial retrained then): its finished run is taken back from
    # previous/, nothing is trained, and model.pt is the first one's, byte for byte; the hidden=16 run is aside now.
    set_training(wd, hidden=32, score=score)
    assert "train_train" in run_snakemake(wd, "-n").stdout
    assert f"the next run takes back this config's finished run set aside in {TRAINED}/previous (step 48), " \
           "training nothing" in run_cli(wd, "status").stdout
    back = run_snakemake(wd)
    assert back.returncode == 0, back.stderr[-3000:]
    log = (trained / "logs/train.log").read_text()
    assert "taken back from" in log and "step 48, epoch 4" in log  # a finished run: its lines replayed, no step run
    assert (trained / "model.pt").read_bytes() == first_model and (trained / "steps.jsonl").read_bytes() == first_steps
    assert json.loads((trained / "done").read_text())["fingerprint"] == done["fingerprint"]
    assert torch.load(trained / "previous/checkpoints/latest.pt", weights_only=False)["model"]["0.weight"].shape == (
        16, 40)


def test_a_training_keys_fingerprint_ignore_holds_for_the_inference_stages_that_use_its_model(tmp_path):
    """step_delay is in the training stage's fingerprint_ignore: changing it retrains nothing, and reruns no inference
    shard, merge or scoring either (the inference stage takes it with the training stage's provider_config; it counts
    through the trained model's fingerprint). A key the inference stage sets itself still counts."""
    wd = make_project(tmp_path / "p", epochs=1)
    result = run_snakemake(wd)
    assert result.returncode == 0, result.stderr[-3000:]
    set_training(wd, step_delay=0.01)
    assert "Nothing to be done" in run_snakemake(wd, "-n").stdout
    status = run_cli(wd, "status").stdout
    assert "stale" not in status and status.count("merged: yes, current") == 6, status
    config = read_config(wd)
    config["stages"]["infer"]["provider_config"] = {"hidden": 16}  # another model than the one trained: counts
    write_config(wd, config)
    dry = run_snakemake(wd, "-n")
    assert "shard_infer" in dry.stdout and "train_train" not in dry.stdout


def test_kill_9_sigterm_and_a_corrupt_latest_pt_end_with_an_uninterrupted_runs_result(tmp_path, tmp_path_factory):
    want = reference(tmp_path_factory, threads=1)
    wd = make_project(tmp_path / "p", step_delay=0.1)
    first, second = sorted(random.sample(range(3, 40), 2))
    killed = interrupt_at(wd, first, signal.SIGKILL)
    assert killed.returncode != 0 and "Error in rule train_train" in killed.stdout
    assert not (wd / TRAINED / "done").exists() and not (wd / TRAINED / "model.pt").exists()
    status = run_cli(wd, "status").stdout
    # latest.pt, or the history file of the same step when the kill fell between the two writes (a CI run drew it)
    assert re.search(r"^stage train \(training\), dataset feats_train: interrupted  \d+ steps logged, newest "
                     r"checkpoint at step (\d+); the next run resumes from \S+/checkpoints/(latest|history/step-\1)"
                     r"\.pt \(step \1\)$", status, re.M), status
    stopped = interrupt_at(wd, max(second, steps_done(wd) + 2), signal.SIGTERM)
    assert stopped.returncode != 0
    log = (wd / TRAINED / "logs/train.log").read_text()
    # at a step, or after an epoch when the signal came during its evaluation (steps 12, 24, 36)
    assert re.search(r"SIGTERM: stopped (at step|after epoch) \d+", log) and "rerun to resume" in log, log[-2000:]
    assert "exit status 75" in stopped.stdout
    (wd / TRAINED / "checkpoints/latest.pt").write_bytes(b"not a checkpoint")  # a disk that lost it
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (wd / TRAINED / "logs/train.log").read_text()
    assert "latest.pt" in log and "history/step-" in log  # the fallback, said
    # in one line, not as a Python warning with snakeshard's source line (a user trial)
    assert re.search(r"^snakeshard: warning: checkpoint \S+/latest.pt is unreadable .*; resuming from \S+/history/"
                     r"step-\d+\.pt instead$", log, re.M), log
    assert "CheckpointWarning" not in log and "manager.load_latest()" not in log, log
    assert "resuming from" in log and re.findall(r"^epoch (\d+) \(step", log, re.M) == ["0", "1", "2", "3"]
    # the epochs of the run before the resume, printed again after its line, say so (a trial took them for new)
    after = re.findall(r"^epoch \d+ \(step.*$", log[log.rindex("resuming from"):], re.M)
    replayed = [line.endswith(" (logged before the resume)") for line in after]
    assert replayed == sorted(replayed, reverse=True) and not replayed[-1], after
    assert_same_training(outputs(wd), want)


def ctrl_c(tmp_path, tmp_path_factory, **how) -> tuple:
    """A training project (1 torch thread) sent SIGINT once a random step is logged (``how``: interrupt_at's group
    or twice): the uninterrupted run's outputs, the project, the step, snakemake's result, the train log."""
    want = reference(tmp_path_factory, threads=1)
    wd = make_project(tmp_path / "p", step_delay=0.1)
    # Twice: not an epoch's last step (12 steps an epoch: 96 keys, batches of 8), whose evaluation ends in the stop
    # before the second Ctrl-C lands (a fresh clone's suite drew step 36 and stopped after epoch 2).
    step = random.choice([s for s in range(3, 41) if not (how.get("twice") and s % 12 == 0)])
    stopped = interrupt_at(wd, step, signal.SIGINT, **how)
    assert stopped.returncode != 0
    return want, wd, step, stopped, (wd / TRAINED / "logs/train.log").read_text()


def test_ctrl_c_checkpoints_at_the_next_step_and_the_rerun_ends_with_an_uninterrupted_runs_result(
        tmp_path, tmp_path_factory):
    """SIGINT to snakemake's process group (a terminal's Ctrl-C) does what SIGTERM does to the training job: a
    checkpoint at the next step boundary, one line, a non-zero exit (a user trial: a KeyboardInterrupt traceback
    and no checkpoint, up to every_seconds of steps lost)."""
    want, wd, step, stopped, log = ctrl_c(tmp_path, tmp_path_factory, group=True)
    assert re.search(r"SIGINT: stopped (at step|after epoch) \d+ .*checkpoint .*latest.pt; rerun to resume", log), \
        log[-2000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    ck = torch.load(wd / TRAINED / "checkpoints/latest.pt", weights_only=False)
    assert ck["progress"]["step"] == steps_done(wd) >= step
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(outputs(wd), want)
    # Snakemake deleted train.log before the rerun; each attempt's log stays under logs/attempts/
    logs = wd / TRAINED / "logs"
    assert sorted(p.name for p in (logs / "attempts").iterdir()) == ["1.log", "2.log"]
    assert (logs / "attempts/1.log").read_text() == log and "SIGINT: stopped" not in (logs / "train.log").read_text()
    assert os.path.samefile(logs / "attempts/2.log", logs / "train.log")


def test_ctrl_c_twice_stops_at_once_unsaved_with_one_line_and_the_rerun_ends_with_an_uninterrupted_runs_result(
        tmp_path, tmp_path_factory):
    """A second Ctrl-C before the step ends: the job stops at once, as a program does by default (no checkpoint at
    that step), with one line and exit 130, no traceback; the rerun resumes from the last interval checkpoint."""
    want, wd, _, stopped, log = ctrl_c(tmp_path, tmp_path_factory, twice=True)
    assert "snakeshard: train: interrupted (SIGINT); rerun to go on" in log, log[-2000:]
    assert "stopped at step" not in log and "stopped after epoch" not in log and "Traceback" not in log, log[-3000:]
    assert "exit status 130" in stopped.stdout or "exit code: 130" in stopped.stdout, stopped.stdout[-2000:]
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(outputs(wd), want)


def test_kill_9_twice_with_two_torch_threads_ends_with_an_uninterrupted_runs_result(tmp_path, tmp_path_factory):
    want = reference(tmp_path_factory, threads=2)
    wd = make_project(tmp_path / "p", step_delay=0.1)
    set_training(wd, threads=2)
    first, second = sorted(random.sample(range(3, 44), 2))
    for step in (first, max(second, first + 2)):
        assert interrupt_at(wd, max(step, steps_done(wd) + 1), signal.SIGKILL).returncode != 0
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in (wd / TRAINED / "logs/train.log").read_text()
    assert_same_training(outputs(wd), want)


def test_negative_control_a_resume_without_the_rng_states_is_caught(tmp_path, tmp_path_factory):
    """The comparison above would fail if the RNG states were not restored: dropout and augmentation draw again."""
    want = reference(tmp_path_factory, threads=1)
    wd = make_project(tmp_path / "p", step_delay=0.1)
    set_training(wd, no_rng_restore=True)
    statuses = []  # status while the job trains (a user trial: it said "interrupted", "snakemake resumes from it")
    assert interrupt_at(wd, 5, signal.SIGKILL, before=lambda: statuses.append(run_cli(wd, "status").stdout)
                        ).returncode != 0  # in epoch 0, whose weights best.pt keeps here
    assert re.search(r"stage train \(training\), dataset feats_train: running  \d+ steps logged.* \(pid \d+ holds "
                     + re.escape(f"{TRAINED}/train.lock") + r"\)$", statuses[0], re.M), statuses[0]
    assert "stage train (training), dataset feats_train: interrupted  " in run_cli(wd, "status").stdout
    assert run_snakemake(wd, TRAIN_TARGET).returncode == 0
    got = outputs(wd)
    assert not all(torch.equal(got["weights"][n], want["weights"][n]) for n in want["weights"])
    assert got["steps"] != want["steps"]


def test_an_unfinished_run_whose_config_changed_is_refused_naming_it_and_goes_on_or_starts_clean_when_asked(tmp_path):
    """Refused, naming the change; resumed when the config goes back; with `snakeshard continue`, resumed under the
    new config and recorded in metrics.json (a researcher's trial: a fix in the code cost the run's steps); or
    started from step 0 after the refusal's rm -r."""
    wd = make_project(tmp_path / "p", step_delay=0.1)
    assert interrupt_at(wd, 10, signal.SIGKILL).returncode != 0
    set_training(wd, lr=0.02)
    # status says what the run then does (a user trial: it said the run resumes, when it was refused)
    status = next(line for line in run_cli(wd, "status").stdout.splitlines() if "(training)" in line)
    assert "; the next run is refused: " in status and "was written by an unfinished run of another config" in status
    assert "provider_config.lr: 0.01 -> 0.02" in status and "sets." not in status, status
    assert f"rm -r {TRAINED}/checkpoints {TRAINED}/steps.jsonl" in status
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode != 0
    line = next(line for line in result.stdout.splitlines() + result.stderr.splitlines()
                if line.startswith("snakeshard: error:"))
    assert "unfinished run of another config or data" in line and "provider_config.lr: 0.01 -> 0.02" in line
    assert "sets." not in line and "code." not in line  # the data and the code did not change: not named
    assert f"rm -r {TRAINED}/checkpoints {TRAINED}/steps.jsonl" in line
    assert line.endswith("; or, to go on with that run's steps under this config and code: snakeshard continue train")
    # the refusal's way back: the old config resumes, and status says so (a user trial: it said "failed", with the
    # refusal's rm -r, after the config was back)
    set_training(wd, lr=0.01)
    status = next(line for line in run_cli(wd, "status").stdout.splitlines() if "(training)" in line)
    # latest.pt, or the history file of its step when the kill -9 fell between the two writes (a CI run drew it)
    assert re.search(r": interrupted  .*checkpoint at step (\d+); the next run resumes from "
                     r"\S+/checkpoints/(latest\.pt|history/step-\1\.pt) \(step \1\)$", status), status
    step = int(re.search(r"\(step (\d+)\)$", status).group(1))
    # the other way: go on under the new config (the user's consent, kept in the run dir and in metrics.json)
    set_training(wd, lr=0.02)
    said = run_cli(wd, "continue", "train")
    assert said.returncode == 0, said.stderr
    assert re.fullmatch(rf"stage train: the next run resumes from \S+ \(step {step}\) under the config and code as "
                        r"they are now \(the config differs \(provider_config.lr: 0.01 -> 0.02\)\); recorded in "
                        rf"{TRAINED}/continued.json\n", said.stdout), said.stdout
    assert run_cli(wd, "continue", "train").stdout.startswith("stage train: nothing to accept: the next run resumes")
    set_training(wd, lr=0.03)  # another edit since: refused again, until accepted again
    assert "; the next run is refused: " in run_cli(wd, "status").stdout
    set_training(wd, lr=0.02)
    assert re.search(rf": interrupted  .*; the next run resumes from \S+ \(step {step}\)$",
                     run_cli(wd, "status").stdout, re.M)
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    reason = f"`snakeshard continue` accepted it at step {step} (the config differs (provider_config.lr: 0.01 -> 0.02))"
    assert f"written under another config, resumed as this one's: {reason}" in (wd / TRAINED / "logs/train.log").read_text()
    metrics = json.loads((wd / TRAINED / "metrics.json").read_text())
    assert metrics["continued"] == [{"step": step, "reason": reason}] and metrics["steps"] == 48
    # its steps after the resume are the new config's: lr 0.02 (a trial: the checkpoint's optimizer state had put
    # the old lr back)
    lrs = {line["step"]: line["lr"] for line in map(json.loads, (wd / TRAINED / "steps.jsonl").read_text().splitlines())
           if "lr" in line}
    assert {lrs[n] for n in range(1, step + 1)} == {0.01} and {lrs[n] for n in range(step + 1, 49)} == {0.02}, lrs
    assert re.search(rf": done  48 steps, 4 epochs, best score .*; went on under a changed config or code at step "
                     rf"{step} \(snakeshard continue\)$", run_cli(wd, "status").stdout, re.M)
    finished = run_cli(wd, "continue", "train")
    assert finished.returncode == 0 and finished.stdout == "stage train: nothing to accept: the next run resumes from " \
        f"{TRAINED}/checkpoints/latest.pt (step 48)\n", finished.stdout  # finished: it writes model.pt again
    assert run_cli(wd, "continue", "nope").stderr.strip().endswith(
        "snakeshard continue nope: no training stage of that name in the config (training stages: train)")
    # the refusal's rm -r: from step 0, and the consent in continued.json (for another checkpoint) is not used
    subprocess.run(["rm", "-r", f"{TRAINED}/checkpoints", f"{TRAINED}/steps.jsonl", f"{TRAINED}/done"], cwd=wd,
                   check=True)
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" not in (wd / TRAINED / "logs/train.log").read_text()
    assert json.loads((wd / TRAINED / "metrics.json").read_text())["continued"] == []
    # a finished training whose config changed since: status names the change, from its finished checkpoint
    set_training(wd, lr=0.03)
    status = next(line for line in run_cli(wd, "status").stdout.splitlines() if "(training)" in line)
    assert (": stale  trained with another config or data (the config differs (provider_config.lr: 0.02 -> 0.03)); "
            "snakemake trains again (") in status, status


def test_snakeshard_continue_accepts_a_config_or_code_change_not_another_data_set_or_number_of_ranks():
    """What `snakeshard continue` refuses, and the refusal's hint then left out: another set's keys (the epochs'
    batch orders are over them) and another number of ranks (the checkpoint holds each rank's RNG states)."""
    from snakeshard.train.consent import refusal_of_consent
    from snakeshard.train.stage import consent_hint

    code = "code.runner: tones.py (its source code)"
    assert refusal_of_consent(["provider_config.lr: 0.01 -> 0.02", code]) is None
    assert consent_hint("train", [code]) == ("; or, to go on with that run's steps under this config and code: "
                                             "snakeshard continue train")
    data = ["sets.feats_train (that set's keys, records, audio or upstream merge)", code]
    assert refusal_of_consent(data) == ("the data differs (sets.feats_train): a run's batch orders are over its keys, "
                                        "so its steps go on over the data they were written with only")
    assert refusal_of_consent(["ranks: 1 -> 2"]) == ("the number of ranks differs: the checkpoint holds each rank's "
                                                     "RNG states")
    assert consent_hint("train", data) == consent_hint("train", ["ranks: 1 -> 2"]) == ""


def test_a_continued_json_that_does_not_read_is_named_with_its_fix(tmp_path):
    from snakeshard.errors import SnakeshardError
    from snakeshard.train.consent import consented

    assert consented(tmp_path, "fp") == {}  # no consent yet
    (tmp_path / "continued.json").write_text('[{"from": "a", "to": "fp"')  # cut short
    with pytest.raises(SnakeshardError, match=r"continued\.json does not read as JSON \(.*\): delete it and run "
                                              r"snakeshard continue again"):
        consented(tmp_path, "fp")


def test_the_training_spec_keeps_data_code_and_config_apart_so_a_refused_resume_names_the_one_that_changed(
        tmp_path, monkeypatch):
    """A refused resume lists what differs between the checkpoint's spec and the current one (loop.config_diff):
    a config change is that key alone, a code change the code alone, a changed recording that set's data alone."""
    from snakeshard.core.fingerprint import result_inputs
    from snakeshard.train.loop import config_diff
    from snakeshard.workflow.parse import Workflow, validate_config

    wd = make_project(tmp_path / "p")
    monkeypatch.chdir(wd)
    monkeypatch.syspath_prepend(str(wd))

    def parsed_spec() -> dict:  # what the parse writes to train.json
        config = read_config(wd)
        validate_config(config)
        return json.loads(Path(Workflow(config).trainings["train"]["spec"]).read_text())

    def changed(before: dict, after: dict) -> list[str]:
        return config_diff(result_inputs(before), result_inputs(after))

    first = parsed_spec()
    assert set(first["sets"]) == {"feats_train", "feats_valid"} and set(first["code"]) == {"runner", "provider"}

    set_training(wd, lr=0.02)
    second = parsed_spec()
    assert changed(first, second) == ["provider_config.lr: 0.01 -> 0.02"]
    assert second["fingerprint"] != first["fingerprint"]

    with open(wd / "tones.py", "a") as f:
        f.write("\n\ndef helper():\n    return 1\n")
    third = parsed_spec()
    assert [line.split(":")[0] for line in changed(second, third)] == [
        "code.provider (its source code)", "code.runner (its source code)"]

    wav = next((wd / "data/wav").glob("train-*.wav"))
    wav.write_bytes(wav.read_bytes()[:-2] + b"\x01\x00")  # one sample of one training recording
    os.utime(wav, ns=(time.time_ns(), time.time_ns() + 10**9))
    fourth = parsed_spec()
    # that set, and what is made from its upstream merge: the stats, and the train split's upstream digest
    assert [line.split(":")[0] for line in changed(third, fourth)] == [
        "sets.feats_train (that set's keys, records, audio or upstream merge)", "stats.inputs",
        "train.upstream_inputs"]
    assert fourth["fingerprint"] != third["fingerprint"]


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("snakeshard: error:")]
    assert lines, (result.stdout + result.stderr)[-3000:]
    return lines[0]


def test_bad_inputs_fail_the_training_job_naming_what_and_where_and_keep_what_was_computed(tmp_path):
    wd = make_project(tmp_path / "p", epochs=2)
    fbank_log = wd / "results/fbank/train/logs/split.0.log"

    # a step takes normalize and the stage sets no stats: named before the model is built
    set_training(wd, stats=None)
    line = error_line(run_snakemake(wd, TRAIN_TARGET))
    assert line.startswith("snakeshard: error: stages.train.stats: tones.TonesRunner.train_step takes 'normalize'")
    assert "add stats: {from_stage: <a collect-stats stage>, dataset: <its dataset>}" in line
    set_training(wd, stats={"from_stage": "stats", "dataset": "feats_train"})

    # the model takes 2 x 40 inputs, the fbank stage gives 20 bins: the evaluation of one valid batch before the
    # first step names keys and shapes (a researcher's trial: a bug in evaluate_step cost the first epoch)
    set_training(wd, num_mel_bins=40)
    result = run_snakemake(wd, TRAIN_TARGET)
    line = error_line(result)
    assert ("tones.TonesRunner.evaluate_step failed before step 1 (one valid batch is evaluated before training, so "
            "that a bug there costs no epoch) (epoch 0, valid batch 0) on keys ['valid-") in line
    assert line.count("'valid-") == 8 and "more" not in line  # every key of the batch of 8, the bad one among them
    assert "mat1 and mat2 shapes cannot be multiplied (8x40 and 80x32)" in line
    assert (wd / TRAINED / "steps.jsonl").read_text() == ""  # no step taken
    status = next(line for line in run_cli(wd, "status").stdout.splitlines() if "(training)" in line)
    assert status.endswith("shapes cannot be multiplied (8x40 and 80x32); the next run starts at step 0 (no "
                           "checkpoint)"), status
    fbank_made = fbank_log.stat().st_mtime
    set_training(wd, num_mel_bins=20)

    # a NaN loss: stops naming step and keys; with skip_nonfinite the batch is skipped and logged, and the run the
    # NaN stopped resumes from its checkpoint (its steps had finite losses: they are skip_nonfinite's too)
    set_training(wd, nan_on_key="train-2-005")
    line = error_line(run_snakemake(wd, TRAIN_TARGET))
    assert "train_step: loss nan at step" in line and "'train-2-005'" in line and "skip_nonfinite: true" in line
    assert int(re.search(r"loss nan at step (\d+)", line)[1]) > 2  # checkpointed before (interval 2)
    assert (wd / TRAINED / "checkpoints/latest.pt").exists()
    # status: the failure, and what the next run does with the config and code as they are now (a researcher's
    # trial: after a fix of the code, the failure alone, and the next run was refused)
    def training_status() -> str:
        return next(line for line in run_cli(wd, "status").stdout.splitlines() if "(training)" in line)

    module = wd / "tones.py"
    source = module.read_text()
    module.write_text(source + "\n\ndef helper():\n    return 1\n")
    status = training_status()
    assert ": failed  " in status and "loss nan at step" in status, status
    assert "; the next run is refused: " in status and "the code differs (code.provider (its source code); " \
        "code.runner (its source code))" in status, status
    module.write_text(source)
    set_training(wd, skip_nonfinite=True)
    assert re.search(r": failed  .*loss nan at step .*; the next run resumes from \S+ \(step \d+\)$",
                     training_status())
    assert run_snakemake(wd, TRAIN_TARGET).returncode == 0
    assert ("written under another config, resumed as this one's: skip_nonfinite was off"
            in (wd / TRAINED / "logs/train.log").read_text())
    resumed = outputs(wd)
    subprocess.run(["rm", "-r", f"{TRAINED}/checkpoints", f"{TRAINED}/steps.jsonl"], cwd=wd, check=True)
    assert run_snakemake(wd, "--forcerun", "train_train", TRAIN_TARGET).returncode == 0
    assert "resumed" not in (wd / TRAINED / "logs/train.log").read_text()
    assert_same_training(outputs(wd), resumed)  # from step 0 with skip_nonfinite: the resumed run's result
    skipped = [json.loads(line) for line in (wd / TRAINED / "steps.jsonl").read_text().splitlines()
               if "skipped_nonfinite" in line]
    assert len(skipped) == 2 and all("train-2-005" in s["skipped_nonfinite"][0] for s in skipped)  # once per epoch
    said = re.findall(r"^step (\d+) \(epoch (\d)\): skipped a batch with a non-finite loss, keys \[.*'train-2-005'",
                      (wd / TRAINED / "logs/train.log").read_text(), re.M)  # the log says so too (a user trial)
    assert said == [(str(s["step"]), str(s["epoch"])) for s in skipped]
    set_training(wd, nan_on_key=None, skip_nonfinite=None)

    # a train_step that returns no loss
    set_training(wd, no_loss=True)
    line = error_line(run_snakemake(wd, TRAIN_TARGET))
    assert "tones.TonesRunner.train_step returned ['acc']: it must return a dict with 'loss'" in line
    set_training(wd, no_loss=None)

    # keys without a label: named before the first step, with the dataset and its dir
    text = wd / "data/train/text"
    kept = text.read_text().splitlines()
    text.write_text("\n".join(line for line in kept if not line.startswith(("train-1-002", "train-3-010"))) + "\n")
    line = error_line(run_snakemake(wd, TRAIN_TARGET))
    assert ("stages.train.labels: 2 of 96 keys of dataset 'feats_train' (data/train) have no 'text': "
            "'train-1-002', 'train-3-010'") in line
    text.write_text("\n".join(kept) + "\n")
    assert fbank_log.stat().st_mtime == fbank_made  # no feature was computed again

    assert run_snakemake(wd, TRAIN_TARGET).returncode == 0


def test_ranks_raise_the_training_jobs_cpus_and_threads(tmp_path):
    """A user trial: ranks: 2 ran 2 rank processes in a job asking for 1 CPU (workers raises it; ranks did not)."""
    wd = make_project(tmp_path / "p", epochs=1)
    set_training(wd, ranks=2)
    dry = run_snakemake(wd, "-n", TRAIN_TARGET)
    assert dry.returncode == 0, dry.stderr[-3000:]
    job = dry.stdout[dry.stdout.index("rule train_train:"):]
    job = job[:job.index("\n\n")] if "\n\n" in job else job
    assert re.search(r"^\s*threads: 2$", job, re.M) and "cpus_per_task=2" in job, job
    set_training(wd, resources={"cpus_per_task": 4})  # a request of one's own stands
    job = run_snakemake(wd, "-n", TRAIN_TARGET).stdout
    assert "cpus_per_task=4" in job[job.index("rule train_train:"):], job


def test_a_stale_upstream_merge_is_refused_by_the_training_job(tmp_path):
    wd = make_project(tmp_path / "p", epochs=1)
    assert run_snakemake(wd, TRAIN_TARGET).returncode == 0
    config = yaml.safe_load((wd / "config/config.yaml").read_text())
    config["stages"]["fbank"]["provider_config"]["num_mel_bins"] = 24
    write(wd, config)
    assert run_snakemake(wd, "-n").returncode == 0  # the parse writes the new plan and train.json
    spec = json.loads((wd / TRAINED / "train.json").read_text())
    result = run_cli(wd, "train", "--spec", f"{TRAINED}/train.json", "--fingerprint", spec["fingerprint"])
    assert result.returncode == 1
    assert "results/fbank/train: the merged output is stale" in error_line(result)


@pytest.mark.parametrize("split", ["train", "valid"])
def test_an_empty_train_or_valid_set_is_refused_naming_it(tmp_path, split):
    wd = make_project(tmp_path / "p", epochs=1)
    for name in ("wav.scp", "text", "utt2spk"):
        (wd / f"data/{split}" / name).write_text("")
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode != 0
    # refused when the workflow is parsed (the fbank stage before the training stage plans the set): no job ran
    assert error_line(result) == (f"snakeshard: error: datasets.{split}: dataset data/{split} has no items: "
                                  f"data/{split}/wav.scp lists no key")
    assert not list((wd / "results").rglob("done"))


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["stages"]["infer"].update(from_stage="fbank"),
     "stages.infer.from_stage: 'fbank' is not a training stage (training stages: ['train'])"),
    (lambda c: c["stages"]["train"].update(valid="feats_train"),
     "stages.train.valid: the same dataset as train ('feats_train'); give a held-out one"),
    (lambda c: c["stages"]["infer"].update(workers=2),
     "stages.infer.workers: an inference stage from a trained model runs in the shard job's own process"),
    (lambda c: c["stages"]["fbank"].update(epochs=3),
     "stages.fbank.epochs: only for a training stage (one with train: <dataset>)"),
    (lambda c: c["stages"]["train"].update(sharding={"num_shards": 2}),
     "stages.train.sharding: not for a training stage"),
    (lambda c: c["stages"]["train"].update(stats={"from_stage": "stats", "dataset": "feats_valid"}),
     "stages.train.stats.dataset: stage 'stats' runs over ['feats_train'], not 'feats_valid'"),
    (lambda c: c["stages"]["train"].update(stats={"from_stage": "fbank", "dataset": "train"}),
     "stages.train.stats.from_stage: stage 'fbank' (runner snakeshard.stages.fbank.FbankRunner) is not a collect-stats "
     "stage: stats: names a stage whose runner is snakeshard.stages.CollectStatsRunner"),
    (lambda c: c["stages"]["train"].pop("valid"),
     "stages.train.score.split: 'valid' (the default) needs a valid: dataset"),
    (lambda c: c["stages"]["train"].update(schedule={"strategy": "step"}),
     "stages.train.schedule.strategy: 'step' is not one of ['cosine', 'linear', 'constant']"),  # the schema's
    (lambda c: c["stages"]["train"].update(schedule={"warmup_ratio": 0.1}),
     "stages.train.schedule.warmup_ratio: not a schedule option (options: strategy, final_lr_ratio, final_lr"),
    (lambda c: c["stages"]["train"].update(schedule={"warmup_steps": "ten"}),
     "stages.train.schedule.warmup_steps: 'ten' is not of type 'integer', 'null'"),
])
def test_training_config_mistakes_fail_the_parse_naming_the_key(tmp_path, monkeypatch, change, message):
    from snakeshard.errors import ConfigError
    from snakeshard.workflow.parse import validate_config

    (tmp_path / "tones.py").write_text(train_project.MODULE)  # the parse finds the runner's module
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = train_project.config()
    change(config)
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    assert message in str(error.value)


def test_an_inference_stages_runner_without_infer_step_fails_the_parse(tmp_path):
    """Found by `snakemake -n`, not by the inference canary after the whole training; an inference stage with its own
    runner (a subclass in another module defining infer_step) passes."""
    wd = make_project(tmp_path / "p")
    module = wd / "tones.py"
    source = module.read_text()
    module.write_text(source[:source.index("    @staticmethod\n    def infer_step")])
    result = run_snakemake(wd, "-n")
    assert result.returncode != 0
    assert error_line(result).startswith("snakeshard: error: stages.infer.runner: tones.TonesRunner defines no "
                                         "infer_step, which an inference stage from a training stage runs")
    (wd / "tones_infer.py").write_text("from tones import TonesRunner\n\n\nclass InferRunner(TonesRunner):\n"
                                       + source[source.index("    @staticmethod\n    def infer_step"):])
    config = read_config(wd)
    config["stages"]["infer"]["runner"] = "tones_infer.InferRunner"
    write_config(wd, config)
    result = run_snakemake(wd, "-n")
    assert result.returncode == 0, result.stderr[-2000:]


def test_inference_over_a_data_dir_names_load_array_and_the_dataset(tmp_path):
    """An inference stage over data/test itself (not fbank's output over it): infer_step's load_array failed with
    `AttributeError: 'KaldiDataset' object has no attribute 'load_array'`."""
    wd = make_project(tmp_path / "p", epochs=1)
    config = read_config(wd)
    config["stages"]["infer"]["datasets"] = ["test"]
    config["datasets"]["predicted"]["dataset"] = "test"
    write_config(wd, config)
    result = run_snakemake(wd)
    assert result.returncode != 0
    log = (wd / "results/infer/test/logs/split.0.log").read_text()
    assert ("datasets.test: load_array('test-0-000', 'feats') reads a field of another stage's merged output, and "
            "dataset 'test' (data/test) is a data dir, not a stage's output: run this stage over a chained dataset"
            in log), log[-2000:]
    assert "AttributeError" not in log


def test_plan_of_a_training_stage_shows_its_sets(tmp_path):
    """`snakeshard plan --stage train` printed nothing (its sets are not shard sets)."""
    wd = make_project(tmp_path / "p")
    proc = run_cli(wd, "plan", "--stage", "train")
    assert proc.returncode == 0, proc.stderr
    for ds in ("feats_train", "feats_valid"):
        assert f"stage train (training: one job over every key of its sets), dataset {ds}:" in proc.stdout


def test_a_training_steps_must_be_staticmethods_checked_at_parse(tmp_path):
    wd = make_project(tmp_path / "p")
    module = wd / "tones.py"
    module.write_text(module.read_text().replace("    @staticmethod\n    def evaluate_step", "    def evaluate_step"))
    result = run_snakemake(wd, "-n")
    assert result.returncode != 0
    assert "tones.TonesRunner.evaluate_step (" in error_line(result) and "must be a @staticmethod" in error_line(result)
    assert not (wd / "results/fbank/train/merged.json").exists()


def test_a_model_pt_that_does_not_fit_the_inference_stages_model_is_named(tmp_path):
    """An inference stage whose own provider_config builds another model than the one trained: one error naming
    model.pt, the training stage, the provider and the mismatched tensors (was torch's multi-line RuntimeError,
    reported as the provider failing to build its env)."""
    from snakeshard.errors import ContractError
    from snakeshard.train.inference import with_trained_model

    torch.save({"model": torch.nn.Linear(40, 4).state_dict()}, tmp_path / "model.pt")
    (tmp_path / "done").write_text(json.dumps({"fingerprint": "f"}))
    spec = {"stage": "infer", "provider": "tones.TonesProvider", "dataset": {"path": "unused"},
            "model": {"stage": "train", "path": str(tmp_path / "model.pt"), "done": str(tmp_path / "done"),
                      "fingerprint": "f", "stats": None}}
    with pytest.raises(ContractError) as error:
        with_trained_model({"model": torch.nn.Linear(20, 4)}, spec)
    message = str(error.value)
    assert message.startswith(f"stages.infer: {tmp_path / 'model.pt'} (trained by stage 'train') does not fit the model "
                              "tones.TonesProvider builds here (Error(s) in loading state_dict for Linear: size mismatch "
                              "for weight: copying a param with shape torch.Size([4, 40])")
    assert "\n" not in message and "its own provider_config keys laid over them" in message


def test_a_model_pt_that_does_not_read_is_named_with_its_fix(tmp_path):
    """A model.pt cut short (a disk fault: it is written atomically) or not torch's: one DataError naming the file,
    torch's reason in one line and the fix (delete the training's done, rerun), not torch's traceback."""
    from snakeshard.errors import DataError
    from snakeshard.train.inference import with_trained_model

    torch.save({"model": torch.nn.Linear(40, 4).state_dict()}, tmp_path / "whole.pt")
    (tmp_path / "done").write_text(json.dumps({"fingerprint": "f"}))
    spec = {"stage": "infer", "provider": "tones.TonesProvider", "dataset": {"path": "unused"},
            "model": {"stage": "train", "path": str(tmp_path / "model.pt"), "done": str(tmp_path / "done"),
                      "fingerprint": "f", "stats": None}}
    for broken in ((tmp_path / "whole.pt").read_bytes()[:100], b"", b"not a torch file\n"):
        (tmp_path / "model.pt").write_bytes(broken)
        with pytest.raises(DataError) as error:
            with_trained_model({"model": torch.nn.Linear(40, 4)}, spec)
        message = str(error.value)
        assert message.startswith(f"stages.infer.from_stage: {tmp_path / 'model.pt'} does not read ("), message
        assert message.endswith(f"); delete {tmp_path / 'done'} and run snakemake, which trains it again"), message
        assert "\n" not in message


def test_an_inference_stage_from_a_runner_without_infer_step_is_refused_at_job_start():
    """TorchRunner's own infer_step only raises: refused before any model loads, naming stage and runner."""
    from snakeshard.errors import ContractError
    from snakeshard.train import TorchRunner
    from snakeshard.train.inference import model_runner

    class TrainOnly(TorchRunner):
        @staticmethod
        def train_step(batch, *, model):
            return {}

    with pytest.raises(ContractError, match=r"stages\.infer\.runner: .*TrainOnly defines no infer_step, which an "
                                            r"inference stage from a training stage runs as its forward"):
        model_runner(TrainOnly, "infer")


def test_a_training_job_waits_for_the_process_holding_its_run_dir_then_trains(tmp_path, tmp_path_factory):
    """A driver killed by -9 leaves its training job running; the rerun's training job must not write the same
    checkpoints and steps.jsonl beside it. Here the test holds train.lock, as that orphan would: the job says
    what it waits for and logs no step until the lock is let go, then trains to an uninterrupted run's result."""
    import fcntl

    want = reference(tmp_path_factory, threads=1)
    wd = make_project(tmp_path / "p")
    (wd / TRAINED).mkdir(parents=True)
    with open(wd / TRAINED / "train.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cmd = [sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2", TRAIN_TARGET]
        driver = subprocess.Popen(cmd, cwd=wd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            log = wd / TRAINED / "logs/train.log"
            wait_for(lambda: log.exists() and "waiting for the training process" in log.read_text()
                     or driver.poll() is not None, 180, "the training job to wait on train.lock")
            assert driver.poll() is None and not (wd / TRAINED / "steps.jsonl").exists()
        except BaseException:
            driver.kill()
            raise
    assert driver.wait(timeout=300) == 0
    assert_same_training(outputs(wd), want)
