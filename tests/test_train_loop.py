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
import threading
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
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except ValueError:  # a line being written
            continue
    return 0


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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])  # SIGINT: Ctrl-C (it was a KeyboardInterrupt, unsaved)
def test_sigterm_checkpoints_exits_75_and_resumes(tmp_path, reference, sig):
    stopped = interrupt_at(tmp_path, 11, sig)  # mid-epoch 1 (steps 9..16), not on an interval
    assert stopped.returncode == 75, stopped.stderr
    assert f"{sig.name}: stopped at step" in stopped.stderr and "Traceback" not in stopped.stderr, stopped.stderr
    ck = torch.load(tmp_path / "checkpoints" / "latest.pt", weights_only=False)
    assert ck["progress"]["step"] == last_step(tmp_path)  # saved at the step boundary after the signal
    assert ck["progress"]["epoch"] == 1 and 0 < ck["progress"]["batch_pos"] < 15
    assert ck["log_bytes"] == (tmp_path / "steps.jsonl").stat().st_size
    assert set(ck["versions"]) == {"torch", "snakeshard"}
    done = run_job(tmp_path)
    assert done.returncode == 0, done.stderr
    assert_same_result(tmp_path, reference(), f"after {sig.name}")


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


# -- in-process: config refusal, early stopping, contract errors, the schedule --

def _toy(lr=0.01):
    from train_toy import ToyProvider

    env = ToyProvider({"threads": 1, "lr": lr}).build_env_local()
    return env, env.pop("train_keys"), env.pop("valid_keys")


SMALL = {"epochs": 1, "batch_size": 32, "seed": 3}


def test_a_run_accepted_under_a_new_lr_goes_on_at_the_new_lr_where_its_schedule_was(tmp_path):
    """`snakeshard continue` after an lr change (train's accepted): the steps after the resume run at the new base
    lr times the cosine schedule's factor at that step, as a run of the new lr from step 0 has them; the moments and
    the schedule's position come from the checkpoint (a trial's lower lr was silently the old one)."""
    from snakeshard.train import TrainingInterrupted, train
    from train_toy import ToyRunner

    config = {**SMALL, "batch_size": 8, "schedule": {"strategy": "cosine"}}  # 8 steps
    env, tk, vk = _toy(lr=0.01)
    env["delay"] = 0.05
    timer = threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    with pytest.raises(TrainingInterrupted) as stopped:
        train(ToyRunner, env, tk[:64], vk, config, tmp_path / "go", fingerprint="a",
              inputs={"provider_config": {"lr": 0.01}})
    timer.join()
    at = stopped.value.step
    assert 0 < at < 8
    env, tk, vk = _toy(lr=0.002)
    result = train(ToyRunner, env, tk[:64], vk, config, tmp_path / "go", fingerprint="b",
                   inputs={"provider_config": {"lr": 0.002}}, accepted={"a": "accepted for the test"})
    assert result.continued == [{"step": at, "reason": "accepted for the test"}]
    env, tk, vk = _toy(lr=0.002)
    train(ToyRunner, env, tk[:64], vk, config, tmp_path / "new", fingerprint="b",
          inputs={"provider_config": {"lr": 0.002}})

    def lrs(run):
        return {line["step"]: line["lr"] for line in map(json.loads, (tmp_path / run / "steps.jsonl").read_text()
                                                          .splitlines()) if "lr" in line}
    went_on, new = lrs("go"), lrs("new")
    assert [went_on[n] for n in range(at + 1, 9)] == pytest.approx([new[n] for n in range(at + 1, 9)], rel=1e-12)
    assert went_on[at] == pytest.approx(new[at] * 5, rel=1e-12)  # the step before: the old base, 5 times the new


def test_changed_config_is_refused_naming_the_key_and_restart_starts_clean(tmp_path):
    """An unfinished run's checkpoint under another config or fingerprint is refused, naming what differs and the
    command that starts over; a finished run's is no run to resume: training starts over by itself."""
    from snakeshard.train import ResumeRefused, TrainingInterrupted, train
    from train_toy import ToyRunner

    config = {**SMALL, "batch_size": 8}  # 8 steps
    env, tk, vk = _toy()
    env["delay"] = 0.05
    timer = threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    with pytest.raises(TrainingInterrupted):
        train(ToyRunner, env, tk[:64], vk, config, tmp_path, fingerprint="a",
              inputs={"provider_config": {"lr": 0.01}})
    timer.join()
    env, tk, vk = _toy()
    with pytest.raises(ResumeRefused) as refused:
        train(ToyRunner, env, tk[:64], vk, {**config, "batch_size": 16}, tmp_path, fingerprint="a",
              inputs={"provider_config": {"lr": 0.01}})
    message = str(refused.value)
    assert "batch_size: 8 -> 16" in message and f"rm -r {tmp_path / 'checkpoints'} {tmp_path / 'steps.jsonl'}" in message
    with pytest.raises(ResumeRefused) as refused:  # a schedule where there was none: shown whole, not key by key
        train(ToyRunner, env, tk[:64], vk, {**config, "schedule": {"strategy": "cosine", "warmup_steps": 2}}, tmp_path,
              fingerprint="a", inputs={"provider_config": {"lr": 0.01}})
    assert "the config differs (schedule: not set -> {'strategy': 'cosine', 'warmup_steps': 2})" in str(refused.value)
    with pytest.raises(ResumeRefused, match=r"the config differs \(provider_config.lr: 0.01 -> 0.02\)"):
        train(ToyRunner, env, tk[:64], vk, config, tmp_path, fingerprint="b", inputs={"provider_config": {"lr": 0.02}})
    with pytest.raises(ResumeRefused, match="the inputs differ .*'a'.*'b'"):
        train(ToyRunner, env, tk[:64], vk, config, tmp_path, fingerprint="b", inputs={"provider_config": {"lr": 0.01}})
    # a checkpoint section change (cadence) changes no result: resumes, and finishes
    resumed = train(ToyRunner, env, tk[:64], vk, {**config, "checkpoint": {"interval": 1}}, tmp_path, fingerprint="a",
                    inputs={"provider_config": {"lr": 0.01}})
    assert resumed.resumed_from is not None and resumed.step == 8
    # finished: another config starts over (no refusal), as after `restart`
    env, tk, vk = _toy()
    result = train(ToyRunner, env, tk[:64], vk, {**config, "batch_size": 16}, tmp_path, fingerprint="a")
    assert result.resumed_from is None and result.step == 4
    ck = torch.load(tmp_path / "checkpoints" / "latest.pt", weights_only=False)
    assert ck["config"]["batch_size"] == 16 and ck["fingerprint"] == "a"
    assert [json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 4]
    result = train(ToyRunner, env, tk[:64], vk, SMALL, tmp_path, fingerprint="a", restart=True)
    assert result.resumed_from is None and result.step == 2


def test_a_misspelt_score_name_fails_before_the_first_step_and_its_fix_trains_as_an_uninterrupted_run(tmp_path):
    """User trial 10: `score: {name: accuracy}` failed where the first epoch ended (evaluate_step gives 'acc'), a
    whole epoch later. One valid batch is now evaluated before the first step: the misspelt name fails there, no
    step taken, nothing written to resume; the fixed config then trains as an uninterrupted run. A score change
    after an epoch ended (a score was taken) is refused."""
    from snakeshard.errors import ContractError
    from snakeshard.train import ResumeRefused, train
    from train_toy import ToyRunner

    config = {"epochs": 2, "batch_size": 16, "seed": 3, "checkpoint": {"interval": 1}}
    good = {**config, "score": {"name": "acc", "mode": "max"}}
    env, tk, vk = _toy()
    with pytest.raises(ContractError, match=r"^stages.<stage>.score.name 'accuracy' is no meter of .*ToyRunner."
                                            r"evaluate_step: it gave \['acc', 'loss'\]"):
        train(ToyRunner, env, tk[:64], vk[:16], {**config, "score": {"name": "accuracy"}}, tmp_path / "a",
              fingerprint="f1", inputs={"provider_config": {"lr": 0.01}})
    assert (tmp_path / "a/steps.jsonl").read_text() == "" and not (tmp_path / "a/checkpoints/latest.pt").exists()
    env, tk, vk = _toy()
    fixed = train(ToyRunner, env, tk[:64], vk[:16], good, tmp_path / "a", fingerprint="f2",
                  inputs={"provider_config": {"lr": 0.01}})
    assert fixed.resumed_from is None and fixed.step == 8 and fixed.best_epoch is not None
    env, tk, vk = _toy()
    whole = train(ToyRunner, env, tk[:64], vk[:16], good, tmp_path / "b", fingerprint="f2",
                  inputs={"provider_config": {"lr": 0.01}})
    for name in ("latest.pt", "best.pt"):
        got, want = (torch.load(tmp_path / run / "checkpoints" / name, weights_only=False) for run in ("a", "b"))
        assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]), name
    assert (whole.step, whole.best_epoch, whole.best_score) == (fixed.step, fixed.best_epoch, fixed.best_score)
    # once an epoch has been scored, another score config is another run: refused
    ck = torch.load(tmp_path / "b/checkpoints/latest.pt", weights_only=False)
    ck["progress"]["finished"] = False  # as if stopped after its epochs' ends, before the run's end
    torch.save(ck, tmp_path / "b/checkpoints/latest.pt")
    env, tk, vk = _toy()
    with pytest.raises(ResumeRefused, match=r"the config differs \(score.mode: 'max' -> 'min'\)"):
        train(ToyRunner, env, tk[:64], vk[:16], {**good, "score": {"name": "acc", "mode": "min"}}, tmp_path / "b",
              fingerprint="f4", inputs={"provider_config": {"lr": 0.01}})


def test_early_stopping_with_patience_and_best_pt(tmp_path):
    from snakeshard.train import TorchRunner, train

    # the first call: the check of one valid batch before training (its value is not a score); then best at
    # epoch 1, epochs 2 and 3 worse: patience 2 stops after 3
    scores = [None, 0.5, 0.7, 0.6, 0.65, 0.9, 0.95]
    snapshots = []

    class Scripted(TorchRunner):
        @staticmethod
        def train_step(batch, *, model, table):
            x = torch.stack([table[k][0] for k in batch])
            return {"loss": model(x).pow(2).mean()}

        @staticmethod
        def evaluate_step(batch, *, model):
            snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
            return {"acc": scores[len(snapshots) - 1]}

    env, tk, vk = _toy()
    result = train(Scripted, env, tk[:64], vk[:4], {"epochs": 6, "batch_size": 64, "score":
                   {"name": "acc", "mode": "max", "patience": 2}}, tmp_path)
    assert (result.epoch, result.stopped_early, result.best_epoch, result.best_score) == (4, True, 1, 0.7)
    assert len(snapshots) == 5
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=False)
    assert best["progress"]["best_epoch"] == 1
    assert all(torch.equal(best["model"][k], snapshots[2][k]) for k in snapshots[2])
    assert not all(torch.equal(best["model"][k], snapshots[4][k]) for k in snapshots[4])
    # a rerun of the finished run trains nothing more
    again = train(Scripted, env, tk[:64], vk[:4], {"epochs": 6, "batch_size": 64, "score":
                  {"name": "acc", "mode": "max", "patience": 2}}, tmp_path)
    assert again.step == result.step and len(snapshots) == 5


def test_contract_errors_name_the_runner_step_and_keys(tmp_path):
    from snakeshard.errors import ContractError
    from snakeshard.train import NonFiniteLoss, TorchRunner, train

    class NoLoss(TorchRunner):
        @staticmethod
        def train_step(batch, *, model):
            return {"acc": 1.0}

    class NaNAt3(TorchRunner):
        @staticmethod
        def train_step(batch, *, model, table):
            x = torch.stack([table[k][0] for k in batch])
            loss = model(x).pow(2).mean()
            return {"loss": loss * float("nan") if "utt0003" in batch else loss}

    env, tk, vk = _toy()
    with pytest.raises(ContractError, match=r"test_train_loop\..*NoLoss\.train_step returned \['acc'\].*'loss'"):
        train(NoLoss, env, tk[:8], (), {"batch_size": 4}, tmp_path / "a")
    with pytest.raises(NonFiniteLoss, match=r"NaNAt3\.train_step: loss nan at step \d+ \(epoch 0, batch \d+\) "
                                            r"on keys \[.*'utt0003'.*\]"):
        train(NaNAt3, env, tk[:8], (), {"batch_size": 4}, tmp_path / "b")
    result = train(NaNAt3, env, tk[:8], (), {"batch_size": 4, "skip_nonfinite": True}, tmp_path / "c")
    assert result.step == 2
    assert "utt0003" in (tmp_path / "c" / "steps.jsonl").read_text()


def test_a_failing_step_names_every_key_of_its_batch_and_evaluation_says_after_which_step(tmp_path):
    """A trial's bad label was among "... 3 more" keys: every key of the batch is named (up to 64), and an
    evaluate_step failing after epoch 0's 2 steps says "after step 2", not "at step 3" (no third step ran)."""
    from snakeshard.train import TorchRunner, train
    from snakeshard.train.loop import StepFailed

    class BadKey(TorchRunner):
        @staticmethod
        def train_step(batch, *, model, table):
            if "utt0007" in batch:
                raise ValueError("invalid literal for int()")
            return {"loss": model(torch.stack([table[k][0] for k in batch])).pow(2).mean()}

        @staticmethod
        def evaluate_step(batch, *, model, table):
            if set(batch) & broken:
                raise RuntimeError("evaluation broke")
            return {"loss": model(torch.stack([table[k][0] for k in batch])).pow(2).mean()}

    env, tk, vk = _toy()
    broken = set(vk[4:8])  # valid batch 1: not the one evaluated before the first step
    with pytest.raises(StepFailed) as failed:
        train(BadKey, env, tk[:16], (), {"batch_size": 8, "seed": 0}, tmp_path / "a")
    named = [k for k in tk[:16] if repr(k) in str(failed.value)]
    assert len(named) == 8 and "utt0007" in named and "more" not in str(failed.value), str(failed.value)
    with pytest.raises(StepFailed, match=r"BadKey\.evaluate_step failed after step 2 \(epoch 0, valid batch 1\)"):
        train(BadKey, env, tk[8:16], vk[:8], {"batch_size": 4}, tmp_path / "b")


def test_evaluate_step_runs_on_one_valid_batch_before_training_so_a_bug_there_costs_no_epoch(tmp_path):
    """A researcher's trial: a bug in evaluate_step showed after a whole epoch, and the fixed code could not resume
    it. One valid batch is evaluated before the first step: the bug fails the run there, with no step taken. That
    check leaves the run as it was: its RNG states are put back (its evaluate_step draws random numbers here), so
    one epoch with valid keys ends with the weights of one without them."""
    from snakeshard.train import TorchRunner, train
    from snakeshard.train.loop import StepFailed
    from train_toy import ToyRunner

    class BrokenEval(ToyRunner):
        @staticmethod
        def evaluate_step(batch, *, model, table):
            return {"f1": undefined_name}  # noqa: F821 (the bug)

    class DrawingEval(ToyRunner):
        @staticmethod
        def evaluate_step(batch, *, model, table):
            torch.rand(1000)  # draws from torch's RNG, which train_step's augmentation uses too
            return ToyRunner.evaluate_step(batch, model=model, table=table)

    env, tk, vk = _toy()
    with pytest.raises(StepFailed, match=r"BrokenEval\.evaluate_step failed before step 1 \(one valid batch is "
                                         r"evaluated before training, so that a bug there costs no epoch\) \(epoch 0, "
                                         r"valid batch 0\) on keys .*NameError: name 'undefined_name' is not defined"):
        train(BrokenEval, env, tk[:32], vk[:8], {"batch_size": 8}, tmp_path / "broken")
    assert (tmp_path / "broken/steps.jsonl").read_text() == ""
    assert issubclass(DrawingEval, TorchRunner)
    config = {"epochs": 1, "batch_size": 8, "seed": 5}
    env, tk, vk = _toy()
    train(DrawingEval, env, tk[:32], vk[:8], config, tmp_path / "valid")
    env, tk, vk = _toy()
    train(DrawingEval, env, tk[:32], (), config, tmp_path / "none")
    got, want = (torch.load(tmp_path / run / "checkpoints/latest.pt", weights_only=False)["model"]
                 for run in ("valid", "none"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_runner_without_evaluate_step_is_refused_before_the_first_step_when_there_are_valid_keys(tmp_path):
    """Found out before training, not after a whole epoch (TorchRunner's own evaluate_step only raises)."""
    from snakeshard.errors import ContractError
    from snakeshard.train import TorchRunner, train

    class TrainOnly(TorchRunner):
        @staticmethod
        def train_step(batch, *, model, table):
            return {"loss": model(torch.stack([table[k][0] for k in batch])).pow(2).mean()}

    env, tk, vk = _toy()
    with pytest.raises(ContractError, match=r"TrainOnly defines no evaluate_step, and there are valid keys"):
        train(TrainOnly, env, tk[:8], vk, {"batch_size": 4}, tmp_path / "a")
    assert not (tmp_path / "a" / "steps.jsonl").exists()  # no step ran
    assert train(TrainOnly, env, tk[:8], (), {"batch_size": 4}, tmp_path / "b").step == 2  # no valid set: fine


def test_schedule_semantics():
    from snakeshard.train.schedule import lr_lambda, make_scheduler

    f = lr_lambda(1.0, 100, strategy="linear", final_lr_ratio=0.01, warmup_steps=10, cooldown_steps=0)
    assert f(0) == pytest.approx(1e-9) and f(5) == pytest.approx(0.5 * 0.01 ** 0.05)
    assert f(100) == pytest.approx(0.01) and f(50) == pytest.approx(0.1)  # percentile: geometric
    g = lr_lambda(1.0, 100, strategy="cosine", final_lr=0.0, warmup_steps=0, cooldown_steps=0)
    assert g(50) == pytest.approx(0.5) and g(100) == pytest.approx(1e-9)  # numerical: linear in the ratio
    c = lr_lambda(2.0, 100, strategy="constant", warmup_steps=0, cooldown_steps=20)
    assert c(10) == 1.0 and c(90) == pytest.approx(0.5)
    d = lr_lambda(1.0, 100)  # DanLing's defaults: 5% warmup, 20% cooldown
    assert d(4) < d(5) and d(81) < d(80)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = make_scheduler(opt, 10, strategy="linear", warmup_steps=0, cooldown_steps=0)
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    sched2 = make_scheduler(opt2, 10, strategy="linear", warmup_steps=0, cooldown_steps=0)
    sched2.load_state_dict(state)
    assert sched2.last_epoch == 5 and sched2.get_last_lr() == sched.get_last_lr()


def test_user_scheduler_state_is_checkpointed(tmp_path):
    from snakeshard.train import train
    from train_toy import ToyRunner

    env, tk, vk = _toy()
    env["scheduler"] = torch.optim.lr_scheduler.StepLR(env["optimizer"], step_size=1, gamma=0.5)
    train(ToyRunner, env, tk[:64], (), {"batch_size": 16, "epochs": 1}, tmp_path)
    ck = torch.load(tmp_path / "checkpoints" / "latest.pt", weights_only=False)
    assert ck["scheduler"]["last_epoch"] == 4 and ck["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.01 / 16)


def test_checkpoints_of_which_none_reads_are_named_with_how_to_start_over(tmp_path):
    """latest.pt and every history file unreadable: one snakeshard error naming each file and the way out,
    no silent fresh start over a run that had checkpoints."""
    from snakeshard.errors import SnakeshardError
    from snakeshard.train.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path / "checkpoints", keep_latest_k=2)
    manager.save({"step": 1}, step=1)
    manager.save({"step": 2}, step=2)
    for path in [manager.latest, *manager.history_files()]:
        path.write_bytes(b"")
    with pytest.raises(SnakeshardError) as e:
        manager.load_latest()
    message = str(e.value)
    assert message.startswith("no readable checkpoint: ") and message.endswith("(or pass restart) to start over")
    assert all(str(p) in message for p in [manager.latest, *manager.history_files()])


def test_a_kill_between_a_history_file_and_latest_pt_resumes_from_the_newer_history_file(tmp_path):
    """A save writes history/step-N.pt, then latest.pt: a kill between them left latest.pt a save behind, and the
    resume took it (a user trial: status said `newest checkpoint at step 280`, the run resumed at 270). The newer
    history file is whole (written atomically): it is the one resumed; an unreadable one is passed over, named."""
    import shutil
    import warnings

    from snakeshard.train.checkpoint import CheckpointManager, CheckpointWarning

    manager = CheckpointManager(tmp_path / "checkpoints", keep_latest_k=3)
    for step in (10, 20):
        manager.save({"progress": {"step": step}}, step=step)
    manager.save({"progress": {"step": 30}}, step=30)
    shutil.copy(manager.history / "step-20.pt", manager.latest)  # latest.pt as the kill before its write left it
    state, path = manager.load_latest()
    assert (state["progress"]["step"], path) == (30, manager.history / "step-30.pt")
    (manager.history / "step-30.pt").write_bytes(b"cut")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state, path = manager.load_latest()
    assert (state["progress"]["step"], path) == (20, manager.latest)
    assert [str(w.message).split(" (")[0] for w in said if w.category is CheckpointWarning] == [
        f"checkpoint {manager.history / 'step-30.pt'} is unreadable"]


def test_a_sound_checkpoint_naming_code_that_does_not_import_is_not_called_unreadable(tmp_path, monkeypatch):
    """A checkpoint holding an object of the user's class (weights_only=False), that class's module gone since: the
    file is sound, so the error says what does not import, and does not advise deleting the checkpoints (it said
    "no readable checkpoint ... Delete <dir> to start over", as for a file cut short; a code review)."""
    import sys

    from snakeshard.errors import SnakeshardError
    from snakeshard.train.checkpoint import CheckpointManager

    (tmp_path / "gone_meter.py").write_text("class Meter:\n    total = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from gone_meter import Meter

    manager = CheckpointManager(tmp_path / "checkpoints", keep_latest_k=2)
    manager.save({"step": 1, "meter": Meter()}, step=1)
    (tmp_path / "gone_meter.py").unlink()
    monkeypatch.delitem(sys.modules, "gone_meter")
    with pytest.raises(SnakeshardError) as e:
        manager.load_latest()
    assert str(e.value).startswith(f"checkpoint {manager.latest} reads, but names code that does not import now "
                                   "(ModuleNotFoundError: No module named 'gone_meter'): restore that module or class")
    assert manager.latest.exists()


@pytest.mark.parametrize("killed_at", [0, 1, 2])
def test_a_kill_inside_a_best_save_never_leaves_a_checkpoint_counting_a_best_that_is_not_on_disk(tmp_path, monkeypatch,
                                                                                                 killed_at):
    """A save that is the best so far writes best.pt, a history file and latest.pt. Killed before any of them
    (a write that raises, as kill -9 would stop it), every checkpoint that holds the new state has best.pt
    beside it holding the same state (the full suite once ended a resumed DDP run on a missing best.pt: the old
    order wrote latest.pt, then best.pt)."""
    import torch

    from snakeshard.train import checkpoint

    manager = checkpoint.CheckpointManager(tmp_path / "checkpoints", keep_latest_k=2)
    manager.save({"step": 1, "best_epoch": 0}, step=1, best=True)
    write = checkpoint.atomic_write_bytes
    calls = []

    def killed(path, data, **kw):
        calls.append(path)
        if len(calls) > killed_at:
            raise KeyboardInterrupt("killed")
        write(path, data, **kw)

    monkeypatch.setattr(checkpoint, "atomic_write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        manager.save({"step": 2, "best_epoch": 1}, step=2, best=True)
    load = lambda p: torch.load(p, weights_only=False)  # noqa: E731
    holding_new = [p for p in [manager.latest, *manager.history_files()] if load(p)["step"] == 2]
    assert not holding_new or load(manager.best)["step"] == 2, (killed_at, holding_new)
    assert load(manager.latest)["step"] == (2 if killed_at > 2 else 1)
