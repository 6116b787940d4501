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
