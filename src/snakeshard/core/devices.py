"""Which devices a shard job may use: its own allocation, named ``cuda:0..N-1``.

SLURM (and CUDA) renumber the GPUs a job was given from 0, so ``cuda:i`` for i < N is
exactly the job's allocation; the values in ``CUDA_VISIBLE_DEVICES`` are physical ids
and must never be used as device indices.

On one machine nothing allocates GPUs to Snakemake's local jobs: each would see every GPU and use the first.
There a job claims its GPUs itself, one lock file per GPU (``flock``, released when the job's process ends,
however it ends), and narrows ``CUDA_VISIBLE_DEVICES`` to them before CUDA starts: four shard jobs with
``gpu: 1`` on a four-GPU machine run on four GPUs, and a fifth waits for one.
"""

from __future__ import annotations

import os
import sys
import time

from snakeshard.errors import ConfigError

GPU_LOCKS = "SNAKESHARD_GPU_LOCKS"  # where a machine's GPU lock files are: this variable, else /tmp/snakeshard-gpus
CLAIMED = "SNAKESHARD_GPUS_CLAIMED"  # set once a job has claimed its GPUs: its own child processes claim none
_held: list[int] = []  # the claimed GPUs' lock file descriptors, open for the life of the process


def visible_gpu_count() -> tuple[int, str]:
    """(number of CUDA devices this process sees, how it was counted)."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    return torch.cuda.device_count(), "torch.cuda.device_count()"


def job_devices(gpus: int, stage: str) -> list[str]:
    """``["cpu"]`` for a CPU stage, else ``cuda:0..gpus-1`` after checking the job really sees that many
    (outside SLURM, after claiming that many of the machine's GPUs: ``claim_local_gpus``)."""
    if gpus <= 0:
        return ["cpu"]
    if "SLURM_JOB_ID" not in os.environ and CLAIMED not in os.environ:
        claim_local_gpus(gpus, stage)
    seen, how = visible_gpu_count()
    if seen < gpus:
        raise ConfigError(
            f"stages.{stage}.resources asks for {gpus} GPU(s), but this job on {os.uname().nodename} sees {seen} "
            f"({how}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
            f"SLURM_JOB_ID={os.environ.get('SLURM_JOB_ID')!r}): submit it to a GPU partition or set gpu: 0"
        )
    return [f"cuda:{i}" for i in range(gpus)]


def requested_gpus(resources: dict) -> int:
    """GPUs a stage asks for: ``gpu: N``, or the count in a ``gres`` like ``gpu:2`` / ``gpu:a100:2``."""
    if resources.get("gpu"):
        return int(resources["gpu"])
    for part in str(resources.get("gres") or "").split(","):
        fields = part.strip().split(":")
        if fields[0] == "gpu":
            return int(fields[-1]) if len(fields) > 1 and fields[-1].isdigit() else 1
    return 0


def claim_local_gpus(gpus: int, stage: str, poll_seconds: float = 1.0) -> list[str] | None:
    """Claim ``gpus`` of this machine's GPUs (those ``CUDA_VISIBLE_DEVICES`` lists, else every one nvidia-smi
    lists) that no other snakeshard job holds, waiting while they are all held, and make them the only ones
    this process and its children see. None, claiming nothing, where the GPUs cannot be listed or are too few
    (``job_devices`` then says what the job sees)."""
    import fcntl

    ids = local_gpu_ids()
    if ids is None or len(ids) < gpus:
        return None
    locks = os.environ.get(GPU_LOCKS, "/tmp/snakeshard-gpus")
    os.makedirs(locks, exist_ok=True)
    try:
        os.chmod(locks, 0o1777)  # other users' jobs lock the same GPUs
    except OSError:
        pass  # made by another user, who opened it up
    said = False
    while True:
        got = []
        for gpu in ids:
            fd = os.open(os.path.join(locks, f"gpu-{gpu}.lock"), os.O_RDONLY | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            got.append((gpu, fd))
            if len(got) == gpus:
                _held.extend(fd for _, fd in got)
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu for gpu, _ in got)
                os.environ[CLAIMED] = "1"
                return [gpu for gpu, _ in got]
        for _, fd in got:  # too few free: none held while waiting, so two waiting jobs cannot block each other
            os.close(fd)
        if not said:
            print(f"stages.{stage}: waiting for {gpus} free GPU(s) of {','.join(ids)}: held by other snakeshard jobs "
                  f"on this machine (locks in {locks}); pass snakemake --resources gpu={len(ids)} to start no "
                  "more GPU jobs than there are GPUs", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_seconds)


def local_gpu_ids() -> list[str] | None:
    """This machine's GPUs as CUDA names them in CUDA_VISIBLE_DEVICES: that variable's list when it is set, else
    nvidia-smi's indices; None where neither tells (no NVIDIA driver)."""
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else None

