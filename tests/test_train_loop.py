"""snakeshard.train: kill -9, SIGTERM and a corrupted checkpoint all resume to the uninterrupted result.

The jobs run as subprocesses of tests/train_toy.py (an MLP with dropout and noise augmentation), so a kill
is a real kill. The kill points are random; TRAIN_KILL_SEED fixes them (the assertion messages name them).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
sys.path.insert(0, str(TESTS))

CONFIG = {"epochs": 4, "batch_size": 16, "accum_steps": 2, "clip_grad_norm": 1.0, "seed": 7,
          "schedule": {"strategy": "cosine"}, "score": {"name": "acc"},
          "checkpoint": {"interval": 5, "keep_latest_k": 3}}
TOTAL_STEPS = 32  # 240 keys / 16 = 15 batches, 8 steps of up to 2 per epoch
DELAY = 0.04      # seconds per train_step in interrupted runs: time to land a kill between steps


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def _cmd(run_dir, config=CONFIG, *extra):
    return [sys.executable, str(TESTS / "train_toy.py"), str(run_dir), json.dumps(config), *extra]


def run_job(run_dir, *extra, config=CONFIG):
    return subprocess.run(_cmd(run_dir, config, *extra), env=_env(), capture_output=True, text=True, timeout=120)


def last_step(run_dir) -> int:
    try:
        lines = (Path(run_dir) / "steps.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return steps[-1] if steps else 0


def interrupt_at(run_dir, step: int, sig, *extra) -> subprocess.CompletedProcess:
    """Start the job, send ``sig`` once steps.jsonl reaches ``step``, wait for it to end."""
    proc = subprocess.Popen(_cmd(run_dir, CONFIG, "--delay", str(DELAY), *extra), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while last_step(run_dir) < step:
        assert proc.poll() is None, f"the job ended before step {step}: {proc.communicate()}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def weights(run_dir):
    return torch.load(Path(run_dir) / "checkpoints" / "latest.pt", weights_only=False)["model"]


def assert_same_result(run_dir, reference, context=""):
    got, want = weights(run_dir), weights(reference)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{context}: weights {differ} differ from the uninterrupted run's"
    assert (Path(run_dir) / "steps.jsonl").read_bytes() == (Path(reference) / "steps.jsonl").read_bytes(), \
        f"{context}: steps.jsonl differs from the uninterrupted run's"


_references: dict = {}


@pytest.fixture
def reference(tmp_path_factory):
    def get(threads: int = 1):
        if threads not in _references:
            run_dir = tmp_path_factory.mktemp(f"reference{threads}")
            done = run_job(run_dir, "--threads", str(threads))
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["step"] == TOTAL_STEPS
            _references[threads] = run_dir
        return _references[threads]
    return get


def kill_points(rng):
    first = rng.randint(3, 14)
    return first, rng.randint(first + 4, 26)


@pytest.mark.parametrize("threads", [1, 2])
def test_kill9_twice_then_resume_matches_uninterrupted(tmp_path, reference, threads):
    seed = int(os.environ.get("TRAIN_KILL_SEED", time.time_ns() % 10**6))
    first, second = kill_points(random.Random(seed))
    context = f"TRAIN_KILL_SEED={seed} (kills at steps {first} and {second}), {threads} threads"
    for step in (first, second):
        killed = interrupt_at(tmp_path, step, signal.SIGKILL, "--threads", str(threads))
        assert killed.returncode == -signal.SIGKILL, context
    done = run_job(tmp_path, "--threads", str(threads))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["resumed_from"], context
    assert_same_result(tmp_path, reference(threads), context)


def test_negative_control_without_rng_restore_the_result_differs(tmp_path, reference):
    """Proves the kill test can fail: the same kill/resume with RNG states not restored gives other weights."""
    seed = int(os.environ.get("TRAIN_KILL_SEED", time.time_ns() % 10**6))
    first, second = kill_points(random.Random(seed))
    for step in (first, second):
        assert interrupt_at(tmp_path, step, signal.SIGKILL, "--no-rng-restore").returncode == -signal.SIGKILL
    done = run_job(tmp_path, "--no-rng-restore")
    assert done.returncode == 0, done.stderr
    got, want = weights(tmp_path), weights(reference())
    assert any(not torch.equal(got[k], want[k]) for k in want), f"TRAIN_KILL_SEED={seed}"
    assert (tmp_path / "steps.jsonl").read_bytes() != (reference() / "steps.jsonl").read_bytes()


def test_sigterm_checkpoints_exits_75_and_resumes(tmp_path, reference):
    stopped = interrupt_at(tmp_path, 11, signal.SIGTERM)  # mid-epoch 1 (steps 9..16), not on an interval
    assert stopped.returncode == 75, stopped.stderr
    assert "SIGTERM" in stopped.stderr
    ck = torch.load(tmp_path / "checkpoints" / "latest.pt", weights_only=False)
    assert ck["progress"]["step"] == last_step(tmp_path)  # saved at the step boundary after the signal
    assert ck["progress"]["epoch"] == 1 and 0 < ck["progress"]["batch_pos"] < 15
    assert ck["log_bytes"] == (tmp_path / "steps.jsonl").stat().st_size
    assert set(ck["versions"]) == {"torch", "snakeshard"}
    done = run_job(tmp_path)
    assert done.returncode == 0, done.stderr
    assert_same_result(tmp_path, reference(), "after SIGTERM")


def test_corrupted_latest_falls_back_to_history(tmp_path, reference):
    assert interrupt_at(tmp_path, 17, signal.SIGTERM).returncode == 75
    ckdir = tmp_path / "checkpoints"
    history = sorted((ckdir / "history").iterdir(), key=lambda p: int(p.stem.split("-")[1]))
    latest = ckdir / "latest.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # truncated
    history[-1].write_bytes(b"")                                          # zero bytes
    leftover = ckdir / ".latest.pt.0123456789ab.tmp"
    leftover.write_bytes(b"half a checkpoint")
    done = run_job(tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"checkpoint {latest} is unreadable" in done.stderr and f"resuming from {history[-2]}" in done.stderr
    assert f"checkpoint {history[-1]} is unreadable" in done.stderr
    assert json.loads(done.stdout)["resumed_from"] == str(history[-2])
    assert not leftover.exists()
    assert_same_result(tmp_path, reference(), "after a corrupted latest.pt")
