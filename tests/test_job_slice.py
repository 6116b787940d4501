"""A shard job holds only its shard's slice of the dataset (split.N/items.json, written by the plan), never
the dataset itself: its memory and start-up do not grow with the dataset."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import copy_workflow, run_snakemake, write_config

# A provider that records what its job opened (a Python audit hook, installed when the job imports this
# module, before the provider runs) and how big the dataset it was given is; forward reports both.
PROBE_MODULE = '''
import resource
import sys

from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard import load_dataset

OPENED = []
sys.addaudithook(lambda event, args: OPENED.append(str(args[0])) if event == "open" else None)


class ProbeProvider(EnvironmentProvider):
    def build_env_local(self):
        return {"dataset": load_dataset(self.config["dataset"])}


class ProbeRunner(BaseRunner):
    @staticmethod
    def forward(key, *, dataset):
        return {"probe": {"dataset_len": len(dataset), "text": dataset[key]["text"],
                          "opened_manifest": any(p.endswith("manifest.jsonl") for p in OPENED),
                          "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}
'''


def probe_project(wd: Path, keys: int) -> Path:
    copy_workflow(wd)
    (wd / "probe.py").write_text(PROBE_MODULE)
    with open(wd / "manifest.jsonl", "w") as f:
        for i in range(keys):
            f.write(json.dumps({"key": f"utt{i:06d}", "text": f"words of utterance {i} " * 4}) + "\n")
    write_config(wd, {"output_dir": "results", "canary": 0,
                      "datasets": {"big": {"path": "manifest.jsonl", "format": "jsonl"}},
                      "stages": {"probe": {"runner": "probe.ProbeRunner", "provider": "probe.ProbeProvider",
                                           "provider_config": {}, "datasets": ["big"],
                                           "fingerprint": {"audio": False},
                                           "sharding": {"shard_size": 100}}}})
    return wd


def run_two_shards(wd: Path) -> list[dict]:
    """Plan (a dry run), then run only the first and the last shard job; their probe records."""
    dry = run_snakemake(wd, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    last = json.loads((wd / "results/probe/big/plan.json").read_text())["num_shards"] - 1
    run = run_snakemake(wd, "results/probe/big/split.0/done", f"results/probe/big/split.{last}/done")
    assert run.returncode == 0, run.stderr[-3000:]
    # the jobs keep their slices, so the next parse reuses the plan instead of reading the dataset again
    assert (wd / "results/probe/big/split.0/items.json").is_file()
    plan_mtime = (wd / "results/probe/big/plan.json").stat().st_mtime_ns
    assert run_snakemake(wd, "-n").returncode == 0
    assert (wd / "results/probe/big/plan.json").stat().st_mtime_ns == plan_mtime
    return [json.loads((wd / f"results/probe/big/split.{n}/probe.jsonl").read_text().splitlines()[0])["value"]
            for n in (0, last)]


def test_a_shard_job_reads_its_slice_not_the_dataset(tmp_path):
    """1,000 and 100,000 keys in shards of 100: each job's dataset holds its 100 keys, with their fields;
    no job opens the manifest; peak RSS of a job differs by less than 20 MB between the two (reading the
    100,000 records would add about 60 MB)."""
    small = run_two_shards(probe_project(tmp_path / "small", 1_000))
    big = run_two_shards(probe_project(tmp_path / "big", 100_000))
    for record in small + big:
        assert record["dataset_len"] == 100 and not record["opened_manifest"], record
    assert big[1]["text"].startswith("words of utterance 99900 ")
    assert abs(max(r["max_rss_kb"] for r in big) - max(r["max_rss_kb"] for r in small)) < 20 * 1024, (small, big)
