"""A training stage on two gloo ranks (``ranks: 2``) in real snakemake runs of tests/train_project.py.

Two ranks train to the end (and inference loads their model.pt); a rank killed with -9 fails the job within
seconds naming it; kill -9 of either rank, of the job, and SIGTERM, then a rerun, end with the weights,
steps.jsonl and metrics.json of an uninterrupted 2-rank run; a 1-rank checkpoint is refused under 2 ranks;
a rank that raises is named with its error; ``ranks`` mistakes fail the parse. The loop on two ranks under
torchrun: accumulation, clipping and skipped non-finite batches keep the replicas equal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_snakemake, wait_for

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")
sys.path.insert(0, str(Path(__file__).parent))
import train_project  # noqa: E402
from test_train_stage import TRAINED, TRAIN_TARGET, error_line, make_project, set_training, steps_done  # noqa: E402

# 96 train keys in batches of 9: 11 per epoch (the last of 6 keys), cut to 10, 5 per rank: 5 steps an epoch
DDP = {"ranks": 2, "batch_size": 9, "epochs": 3}
STEPS, KEYS_PER_EPOCH = 15, 90


def ddp_project(root: Path, step_delay: float = 0.0, **changes) -> Path:
    """The test project training on 2 ranks; ``changes`` as set_training takes them (None leaves a key out)."""
    wd = make_project(root, step_delay=step_delay, **DDP)
    if changes:
        set_training(wd, **changes)
    return wd


def outputs(wd: Path) -> dict:
    """model.pt's weights (the best epoch's), the last checkpoint's, steps.jsonl and metrics.json."""
    trained = wd / TRAINED
    return {"best": torch.load(trained / "model.pt", weights_only=False)["model"],
            "last": torch.load(trained / "checkpoints/latest.pt", weights_only=False)["model"],
            "steps": (trained / "steps.jsonl").read_bytes(), "metrics": (trained / "metrics.json").read_bytes()}


def assert_same(got: dict, want: dict) -> None:
    for which in ("best", "last"):
        assert got[which].keys() == want[which].keys()
        for name in want[which]:
            assert torch.equal(got[which][name], want[which][name]), (which, name)
    assert got["steps"] == want["steps"]  # every step's merged loss, accuracy and lr
    assert got["metrics"] == want["metrics"]


def job_process(wd: Path, rank: int | None):
    """The training job (rank None: the launcher) or one of its rank processes, found by command line and RANK."""
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmd = proc.info["cmdline"] or []
        if not ("train" in cmd and "--spec" in cmd and proc.info["cwd"] == str(wd)):
            continue
        try:
            if rank is None and "--rank-worker" not in cmd:
                return proc
            if rank is not None and "--rank-worker" in cmd and proc.environ().get("RANK") == str(rank):
                return proc
        except psutil.NoSuchProcess:
            continue
    return None


def rank_processes(wd: Path) -> list:
    return [p for p in psutil.process_iter(["cmdline", "cwd"])
            if "--rank-worker" in (p.info["cmdline"] or []) and p.info["cwd"] == str(wd)]


def interrupt(wd: Path, step: int, sig: int, rank: int | None):
    """Run the training target; once ``step`` steps are logged, send ``sig`` to rank ``rank`` (None: the job);
    (the finished snakemake, seconds from the signal to snakemake's exit)."""
    cmd = [sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2", TRAIN_TARGET]
    driver = subprocess.Popen(cmd, cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: steps_done(wd) >= step or driver.poll() is not None, 180, f"step {step}")
        proc = job_process(wd, rank)
        assert proc is not None and driver.poll() is None, "the training job ended before it could be interrupted"
        sent = time.monotonic()
        proc.send_signal(sig)
        out, _ = driver.communicate(timeout=180)
        took = time.monotonic() - sent
    finally:
        if driver.poll() is None:
            driver.kill()
    return subprocess.CompletedProcess(cmd, driver.returncode, out, ""), took


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-rank run of the whole project (training, inference from its model.pt, scoring)."""
    wd = ddp_project(tmp_path_factory.mktemp("ddp_reference") / "p")
    result = run_snakemake(wd)
    assert result.returncode == 0, result.stderr[-3000:]
    return wd, outputs(wd)


def test_two_gloo_ranks_train_to_the_end_and_inference_loads_their_model(reference):
    wd, _ = reference
    trained = wd / TRAINED
    for name in ("model.pt", "metrics.json", "curve.png", "done"):
        assert (trained / name).exists(), name
    lines = [json.loads(line) for line in (trained / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "lr" in line] == list(range(1, STEPS + 1))
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and [e["step"] for e in metrics["per_epoch"]] == [5, 10, 15]
    for epoch in metrics["per_epoch"]:  # both ranks' batches, merged: 10 of the 11 batches, 9 keys each
        assert epoch["train_state"]["meters"]["loss"]["count"] == KEYS_PER_EPOCH
        assert epoch["valid_state"]["meters"]["loss"]["count"] == 24  # rank r took valid batches r::2
    checkpoint = torch.load(trained / "checkpoints/latest.pt", weights_only=False)
    assert checkpoint["world_size"] == 2 and len(checkpoint["rng"]) == 2  # each rank's RNG states
    assert checkpoint["rng"][0]["torch"].ne(checkpoint["rng"][1]["torch"]).any()  # seeded seed + rank
    model = torch.load(trained / "model.pt", weights_only=False)["model"]
    assert list(model) == ["0.weight", "0.bias", "3.weight", "3.bias"]  # the module's, not DDP's "module.*"
    log = (trained / "logs/train.log").read_text()
    assert "training stage 'train': 2 ranks (torchrun, DDP on backend gloo), devices ['cpu', 'cpu']" in log
    assert f"training stage 'train': {STEPS} steps, 3 epochs" in log
    assert [json.loads((trained / f"logs/rank-{r}.json").read_text())["exit"] for r in (0, 1)] == [0, 0]
    scored = json.loads((wd / "results/score/predicted/metrics.json").read_text())
    assert scored["metrics"]["classification"]["value"]["accuracy"] >= 0.9


def test_a_killed_rank_fails_the_job_in_seconds_naming_it_and_every_interruption_resumes_exactly(tmp_path, reference):
    _, want = reference
    wd = ddp_project(tmp_path / "p", step_delay=0.1)
    killed, took = interrupt(wd, 3, signal.SIGKILL, rank=1)
    assert killed.returncode != 0 and "Error in rule train_train" in killed.stdout
    assert took < 60, took
    line = error_line(killed)
    assert "stages.train: rank 1 of 2 died of SIGKILL (exit code -9, pid " in line, line
    assert f"a rerun resumes from {TRAINED}/checkpoints/latest.pt" in line
    assert not (wd / TRAINED / "done").exists() and not (wd / TRAINED / "model.pt").exists()
    print(f"kill -9 of rank 1 to snakemake's exit: {took:.2f} s")

    killed, took = interrupt(wd, steps_done(wd) + 2, signal.SIGKILL, rank=0)  # the rank that writes
    assert killed.returncode != 0 and took < 60, took
    assert "rank 0 of 2 died of SIGKILL (exit code -9" in error_line(killed)

    killed, _ = interrupt(wd, steps_done(wd) + 2, signal.SIGKILL, rank=None)  # the job itself: its ranks go too
    assert killed.returncode != 0
    wait_for(lambda: not rank_processes(wd), 10, "the ranks of a killed job to end")

    stopped, _ = interrupt(wd, steps_done(wd) + 2, signal.SIGTERM, rank=None)
    assert "exit status 75" in stopped.stdout
    log = (wd / TRAINED / "logs/train.log").read_text()
    assert re.search(r"SIGTERM: stopped (at step|after epoch) \d+", log), log[-3000:]  # after: in its evaluation
    assert "SIGTERM: the 2 ranks stopped at a step boundary" in log, log[-3000:]

    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in (wd / TRAINED / "logs/train.log").read_text()
    assert_same(outputs(wd), want)


def test_the_rank_named_is_the_one_not_dead_of_the_launchers_sigterm(tmp_path):
    """The launcher stops the other ranks with SIGTERM; under load its poll saw rank 0 gone of that SIGTERM beside
    rank 1's kill -9 (neither wrote a status file), and the job named rank 0 (a suite run on a loaded machine)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from snakeshard.errors import SnakeshardError
    from snakeshard.train.ranks import _failed

    failures = {0: ProcessFailure(0, 101, -signal.SIGTERM, ""), 1: ProcessFailure(1, 102, -signal.SIGKILL, "")}
    with pytest.raises(SnakeshardError, match=r"stages.train: rank 1 of 2 died of SIGKILL \(exit code -9, pid 102\)"):
        _failed("train", failures, tmp_path, 2, tmp_path / "latest.pt")
    with pytest.raises(SnakeshardError, match=r"rank 0 of 2 died of SIGTERM \(exit code -15, pid 101\)"):
        _failed("train", {0: failures[0]}, tmp_path, 2, tmp_path / "latest.pt")  # a SIGTERM alone is named


def test_a_one_rank_checkpoint_is_refused_under_two_ranks_naming_the_world_size(tmp_path, reference):
    _, want = reference
    wd = ddp_project(tmp_path / "p", step_delay=0.1, ranks=None)
    killed, _ = interrupt(wd, 4, signal.SIGKILL, rank=None)
    assert killed.returncode != 0
    set_training(wd, ranks=2)
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode != 0
    line = error_line(result)
    assert "stages.train: rank 0 of 2 failed (exit code 1): " in line
    assert "unfinished run of another config or data: the config differs (ranks (the world size): 1 -> 2)" in line
    assert f"rm -r {TRAINED}/checkpoints {TRAINED}/steps.jsonl" in line
    subprocess.run(["rm", "-r", f"{TRAINED}/checkpoints", f"{TRAINED}/steps.jsonl"], cwd=wd, check=True)
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same(outputs(wd), want)  # started over clean: the 2-rank run's result


def test_a_rank_that_raises_fails_the_job_naming_it_and_its_error(tmp_path):
    wd = ddp_project(tmp_path / "p", nan_on_key="train-2-005")
    result = run_snakemake(wd, TRAIN_TARGET)
    assert result.returncode != 0
    line = error_line(result)
    statuses = [json.loads((wd / TRAINED / f"logs/rank-{r}.json").read_text()) for r in (0, 1)]
    raised = next(s["rank"] for s in statuses if "loss nan" in (s["error"] or ""))
    assert f"stages.train: rank {raised} of 2 failed (exit code 1): " in line, line
    assert "train_step: loss nan at step" in line and "'train-2-005'" in line
    other = statuses[1 - raised]
    assert other["follows"], other  # it stopped because this rank was gone: not named as the cause


def test_a_rank_stopped_by_the_launcher_after_writing_its_error_is_named_with_its_own_exit_code(tmp_path):
    """Both ranks refuse a checkpoint; rank 1 exits first, and the launcher's SIGTERM reaches rank 0 after it wrote
    its status (CI saw this race once: "exit code -15"). The line names rank 0's error with the code it chose."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from snakeshard.errors import SnakeshardError
    from snakeshard.io.atomic import atomic_write_json
    from snakeshard.train import ranks

    error = "results/x/checkpoints/latest.pt is an unfinished run of another config"
    (tmp_path / "logs").mkdir()
    for rank in (0, 1):
        atomic_write_json(ranks.status_path(tmp_path, rank), {"rank": rank, "exit": 1, "error": error,
                                                              "follows": False, "time": 100.0 + rank})
    failures = {0: ProcessFailure(0, 11, -15, "/nonexistent"), 1: ProcessFailure(1, 12, 1, "/nonexistent")}
    with pytest.raises(SnakeshardError) as raised:
        ranks._failed("train", failures, tmp_path, 2, tmp_path / "checkpoints/latest.pt")
    assert str(raised.value) == f"stages.train: rank 0 of 2 failed (exit code 1): {error}; the other ranks were stopped"


@pytest.mark.parametrize(("change", "message"), [
    ({"ranks": 0}, "stages.train.ranks: 0 is less than the minimum of 1"),
    ({"ranks": "two"}, "stages.train.ranks: 'two' is not of type 'integer'"),
    ({"ranks": 3, "resources": {"gpu": 2}},
     "stages.train.ranks: 3, and stages.train.resources asks for 2 GPU(s): one rank runs on each GPU"),
])
def test_ranks_mistakes_fail_the_parse_naming_stages_train_ranks(tmp_path, monkeypatch, change, message):
    from snakeshard.errors import ConfigError
    from snakeshard.workflow.parse import validate_config

    (tmp_path / "tones.py").write_text(train_project.MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = train_project.config()
    config["stages"]["train"].update(change)
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    assert message in str(error.value)


def test_ranks_checked_past_the_schema_and_only_for_training_stages(tmp_path, monkeypatch):
    from snakeshard.errors import ConfigError
    from snakeshard.workflow.parse import validate_config
    from snakeshard.workflow.train_config import _check_ranks, loop_config

    for bad in (0, "two", True, 1.5):
        with pytest.raises(ConfigError, match=r"stages\.train\.ranks: .* is not a number of ranks"):
            _check_ranks("stages.train", {"ranks": bad})
    assert loop_config({"ranks": 1}) == loop_config({}) == {}  # ranks: 1 is the run without ranks: same fingerprint
    assert loop_config({"resources": {"gpu": 2}})["ranks"] == 2  # one rank per GPU by default
    (tmp_path / "tones.py").write_text(train_project.MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = train_project.config()
    config["stages"]["fbank"]["ranks"] = 2
    with pytest.raises(ConfigError, match=r"stages\.fbank\.ranks: only for a training stage"):
        validate_config(config)


def test_two_ranks_with_accumulation_clipping_and_skipped_nonfinite_batches_keep_equal_replicas(tmp_path):
    """The loop under torchrun (tests/train_toy.py): a rank that skips a non-finite batch still joins the gradient
    reduction, so the ranks take the same optimizer steps and end with the same weights."""
    config = {"epochs": 2, "batch_size": 16, "accum_steps": 2, "clip_grad_norm": 1.0, "seed": 7,
              "schedule": {"strategy": "cosine"}, "skip_nonfinite": True, "checkpoint": {"interval": 3}}
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "0", str(tests / "train_toy.py"), str(tmp_path / "run"),
                             json.dumps(config), "--nan-key", "utt0005"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2 and ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["step"] == 8  # 240 keys / 16: 15 batches, cut to 14, 7 per rank, 4 steps of 2 an epoch
    lines = [json.loads(line) for line in (tmp_path / "run/steps.jsonl").read_text().splitlines()]
    skipped = [line for line in lines if "skipped_nonfinite" in line]
    assert len(skipped) == 2 and all("utt0005" in s["skipped_nonfinite"][0] for s in skipped)  # once an epoch
