"""GPU requests and the devices a shard job hands its provider."""

from __future__ import annotations

import pytest

from snakeshard.core.devices import job_devices, visible_gpu_count
from snakeshard.core.devices import requested_gpus
from snakeshard.errors import ConfigError


@pytest.mark.parametrize("resources, gpus", [
    ({}, 0), ({"gpu": 0}, 0), ({"gpu": 2}, 2), ({"gres": "gpu:1"}, 1), ({"gres": "gpu:a100:4"}, 4),
    ({"gres": "gpu"}, 1), ({"gres": "tmpdisk:100,gpu:2"}, 2), ({"gres": "tmpdisk:100"}, 0),
])
def test_requested_gpus_from_gpu_or_gres(resources, gpus):
    """gpu: N, or the count in a gres string (gpu, gpu:N, gpu:model:N, among other gres) gives the GPUs asked for."""
    assert requested_gpus(resources) == gpus


def test_cpu_stage_gets_cpu():
    """A stage asking for no GPU runs on ["cpu"], whatever the machine has."""
    assert job_devices(0, "asr") == ["cpu"]


def test_more_gpus_than_visible_fails_naming_stage_and_counts():
    """Asking for one GPU more than this process sees: ConfigError naming the stage, the request and what is seen."""
    seen, _ = visible_gpu_count()
    with pytest.raises(ConfigError, match=rf"stages.asr.resources asks for {seen + 1} GPU\(s\), but this job on .* sees {seen}"):
        job_devices(seen + 1, "asr")


CLAIM = """
import os, sys, time
from snakeshard.core.devices import claim_local_gpus
print(claim_local_gpus(1, "vad", poll_seconds=0.05), os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_local_jobs_claim_distinct_gpus_and_one_waits_for_a_gpu_a_killed_job_held(tmp_path):
    """Three local jobs asking for one GPU each on a machine of two (CUDA_VISIBLE_DEVICES lists them: the locks
    need no GPU, so this runs anywhere): the first two get one each and see only it; the third says it waits,
    and gets the GPU of the first once that one is killed with -9 (a flock ends with its process)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b", "SNAKESHARD_GPU_LOCKS": str(tmp_path / "locks")}
    env.pop("SNAKESHARD_GPUS_CLAIMED", None)

    def job(seconds: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", CLAIM, str(seconds)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    first = job(60)
    assert first.stdout.readline().split() == ["['GPU-a']", "GPU-a"]
    second = job(60)
    assert second.stdout.readline().split() == ["['GPU-b']", "GPU-b"]
    third = job(0)
    try:
        waited = third.stderr.readline()
        assert waited.startswith("stages.vad: waiting for 1 free GPU(s) of GPU-a,GPU-b: held by other snakeshard "
                                 f"jobs on this machine (locks in {tmp_path / 'locks'}); pass snakemake --resources "
                                 "gpu=2"), waited
        time.sleep(0.3)
        assert third.poll() is None  # still waiting
        first.send_signal(signal.SIGKILL)
        out, _ = third.communicate(timeout=30)
        assert out.split() == ["['GPU-a']", "GPU-a"] and third.returncode == 0
    finally:
        for proc in (first, second, third):
            proc.kill()
            proc.wait()
