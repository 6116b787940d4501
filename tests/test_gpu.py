"""Stages on a CUDA GPU (``resources: {gpu: 1}``), in real snakemake runs: skipped, saying so, where torch sees no
GPU (CI and the 2-core development machines); run on a lent H100/H200 (bench/RESULTS.md, section 30).

* training (the docs' tones example as written) then inference and scoring on ``cuda:0``; model.pt holds CPU
  tensors, so it loads on a machine without a GPU;
* kill -9 of a GPU training job mid-run: the rerun resumes (CUDA RNG states restored) and ends with the
  uninterrupted GPU run's weights, steps.jsonl and metrics.json, bit for bit;
* the digits recipe on real speech (FSDD) trained and inferred on the GPU, scored as on the CPU;
* silero-vad on the GPU gives the CPU's speech segments.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import copy_workflow, read_config, run_snakemake

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
sys.path.insert(0, str(Path(__file__).parent))
from test_train_stage import (TRAIN_TARGET, TRAINED, assert_same_training, docs_example_project,  # noqa: E402
                              interrupt_at, make_project, outputs, steps_done, write)

GPU = {"gpu": 1}


def on_gpu(wd: Path, *stages: str) -> None:
    config = read_config(wd)
    for stage in stages:
        config["stages"][stage]["resources"] = {**(config["stages"][stage].get("resources") or {}), **GPU}
    write(wd, config)


def test_the_docs_training_example_trains_infers_and_scores_on_the_gpu_and_its_model_loads_without_one(tmp_path):
    wd = docs_example_project(tmp_path / "p")
    on_gpu(wd, "train", "infer")
    result = run_snakemake(wd)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (wd / TRAINED / "logs/train.log").read_text()
    assert "devices ['cuda:0']" in log, log[-2000:]
    infer_logs = "".join(p.read_text() for p in (wd / "results/infer/feats_test").glob("logs/*.log"))
    assert "stages.infer: devices ['cuda:0']" in infer_logs, infer_logs[-2000:]
    model = torch.load(wd / TRAINED / "model.pt", weights_only=False)  # no map_location: as saved
    assert {t.device.type for t in model["model"].values()} == {"cpu"}
    latest = torch.load(wd / TRAINED / "checkpoints/latest.pt", map_location="cpu", weights_only=False)
    assert latest["rng"]["cuda"], "the checkpoint holds no CUDA RNG state"
    scored = json.loads((wd / "results/score/predicted/metrics.json").read_text())
    assert scored["metrics"]["classification"]["value"]["accuracy"] >= 0.9


def test_kill_9_of_a_gpu_training_job_resumes_to_the_uninterrupted_gpu_runs_result(tmp_path):
    reference = make_project(tmp_path / "ref")
    on_gpu(reference, "train")
    result = run_snakemake(reference, TRAIN_TARGET)
    assert result.returncode == 0, result.stderr[-3000:]

    wd = make_project(tmp_path / "killed", step_delay=0.05)
    on_gpu(wd, "train")
    killed = interrupt_at(wd, 20, signal.SIGKILL)
    assert killed.returncode != 0 and 20 <= steps_done(wd) < 48, killed.stdout[-2000:]
    rerun = run_snakemake(wd, TRAIN_TARGET)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in (wd / TRAINED / "logs/train.log").read_text()
    assert_same_training(outputs(wd), outputs(reference))


def test_the_digits_recipe_on_the_gpu_scores_as_on_the_cpu(tmp_path):
    from test_recipe_digits import FSDD, init

    if not FSDD.is_dir():
        pytest.skip(f"no FSDD recordings at {FSDD}")
    accuracy = {}
    for device in ("cpu", "gpu"):
        wd = init(tmp_path / device)
        if device == "gpu":
            config = yaml.safe_load((wd / "config/config.yaml").read_text())
            for stage in ("train", "infer"):
                config["stages"][stage]["resources"].update(GPU)
            (wd / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        start = time.monotonic()
        run = run_snakemake_recipe(wd)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        print(f"digits recipe on the {device}: {time.monotonic() - start:.1f} s, from nothing to its score")
        log = (wd / "results/train/feats_train/logs/train.log").read_text()
        assert ("devices ['cuda:0']" in log) == (device == "gpu"), log[-2000:]
        scored = json.loads((wd / "results/score/predicted/metrics.json").read_text())
        accuracy[device] = scored["metrics"]["classification"]["value"]["accuracy"]
    print(f"digits recipe test accuracy: {accuracy}")
    # float kernels differ between CPU and GPU: the same seeds train a model a take or two apart of 500
    assert accuracy["gpu"] >= 0.97 and abs(accuracy["gpu"] - accuracy["cpu"]) <= 0.01, accuracy


def run_snakemake_recipe(wd: Path):
    import subprocess

    return subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local", "--cores", "4"],
                          cwd=wd, capture_output=True, text=True, timeout=900)


def test_silero_vad_on_the_gpu_finds_the_cpus_speech_segments(tmp_path):
    pytest.importorskip("silero_vad")
    import kaldiio
    import numpy as np

    found = {}
    for device in ("cpu", "gpu"):
        wd = vad_project(tmp_path / device)
        if device == "gpu":
            on_gpu(wd, "vad")
        run = run_snakemake(wd, "results/vad/demo/merged.json")
        assert run.returncode == 0, run.stderr[-3000:]
        out = wd / "results/vad/demo"
        found[device] = ((out / "speech.jsonl").read_text(), kaldiio.load_scp(str(out / "speech_prob.scp")))
    assert found["gpu"][0] == found["cpu"][0]  # the segments, to the millisecond
    cpu, gpu = found["cpu"][1], found["gpu"][1]
    assert cpu.keys() == gpu.keys()
    worst = max(float(np.abs(cpu[k] - gpu[k]).max()) for k in cpu)
    print(f"silero-vad speech probability, largest |gpu - cpu|: {worst:.2e}")
    assert worst < 1e-2  # 4.2e-3 on an H200 (cuDNN's kernels against the CPU's), far from moving a segment


def vad_project(root: Path) -> Path:
    """The shipped workflow with its vad stage over data/demo alone (2 shards)."""
    wd = copy_workflow(root)
    config = read_config(wd)
    config["datasets"] = {"demo": config["datasets"]["demo"]}
    config["stages"] = {"vad": config["stages"]["vad"]}
    write(wd, config)
    return wd


def test_two_local_gpu_jobs_on_a_one_gpu_machine_take_turns(tmp_path):
    """The local profile starts vad's two shard jobs (gpu: 1) at once on a machine of one GPU: one claims it, the
    other says it waits and runs once the first has ended; both see that GPU alone as cuda:0."""
    pytest.importorskip("silero_vad")
    if torch.cuda.device_count() != 1:
        pytest.skip(f"checks a machine of one GPU (this one has {torch.cuda.device_count()})")
    wd = vad_project(tmp_path / "p")
    config = read_config(wd)
    config["canary"] = 0
    config["stages"]["vad"]["sharding"] = {"num_shards": 2}
    write(wd, config)
    on_gpu(wd, "vad")
    run = run_snakemake(wd, "results/vad/demo/merged.json")  # --cores 2
    assert run.returncode == 0, run.stderr[-3000:]
    logs = [(wd / f"results/vad/demo/logs/split.{n}.log").read_text() for n in (0, 1)]
    assert all("stages.vad: devices ['cuda:0'] (CUDA_VISIBLE_DEVICES=" in log for log in logs), logs
    assert sum("stages.vad: waiting for 1 free GPU(s) of " in log for log in logs) == 1, logs

