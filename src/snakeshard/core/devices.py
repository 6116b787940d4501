"""Which devices a shard job may use: its own allocation, named ``cuda:0..N-1``.

SLURM (and CUDA) renumber the GPUs a job was given from 0, so ``cuda:i`` for i < N is
exactly the job's allocation; the values in ``CUDA_VISIBLE_DEVICES`` are physical ids
and must never be used as device indices.
"""

from __future__ import annotations

import os

from snakeshard.errors import ConfigError


def visible_gpu_count() -> tuple[int, str]:
    """(number of CUDA devices this process sees, how it was counted)."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    return torch.cuda.device_count(), "torch.cuda.device_count()"


def job_devices(gpus: int, stage: str) -> list[str]:
    """``["cpu"]`` for a CPU stage, else ``cuda:0..gpus-1`` after checking the job really sees that many."""
    if gpus <= 0:
        return ["cpu"]
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
