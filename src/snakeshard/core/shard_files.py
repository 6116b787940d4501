"""The files the plan writes for a stage (its ``spec.json``, each ``split.N`` directory), and how a job reads them.

Apart from plan.py (which writes them) so that a shard job need not import the planner.
"""

from __future__ import annotations

import json
import os

KEYS_FILE = "keys"  # the shard's keys, one per line (fingerprint.keys_text)
SHARD_ITEMS = "items.json"  # the shard's slice of the dataset: what load_dataset reads in the job (data.py)
# The shard's current fingerprint, written at each parse when it changes: an input of the shard's rule, so that
# Snakemake's mtime trigger reruns a stale shard (workflow/parse.py write_shard_fingerprint). A dot file: no field
# name can take it.
SHARD_FINGERPRINT = ".fingerprint"
SET_SPEC = "spec.json"  # in a set's dir, from each parse: what its shard jobs run (workflow.parse.run_spec)
CANARY_SPEC = ".spec.json"  # beside a canary's dir (<dir>.spec.json): the spec of a canary over a chained dataset
FINGERPRINTS_FILE = "fingerprints.json"  # beside plan.json, from each parse: what readers of merged output check
MERGE_LOG = "logs/merge.log"  # in a set's dir: the merge rule's log (merge.smk), which `snakeshard status` reads


def read_fingerprints(set_dir: str | os.PathLike) -> dict | None:
    """The fingerprints the last parse computed for ``set_dir`` (workflow.parse.Workflow), or None."""
    try:
        with open(os.path.join(set_dir, FINGERPRINTS_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_spec(path: str) -> dict:
    """A stage's ``spec.json`` (written at each parse, see workflow.parse.run_spec)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_keys_file(shard_dir: str | os.PathLike) -> tuple[list[str], bytes]:
    """The keys of ``shard_dir/keys`` (one per line, as ``keys_text`` writes them) and the file's bytes."""
    with open(os.path.join(shard_dir, KEYS_FILE), "rb") as f:
        raw = f.read()
    return raw.decode("utf-8").split("\n")[:-1], raw


def read_shard_keys(shard_dir: str | os.PathLike) -> list[str]:
    return read_keys_file(shard_dir)[0]


def shard_job_files(base: str, shard: int, shards_per_job: int, num_shards: int, grouped: bool) -> tuple[str, str]:
    """(log, rule output) of the job running ``shard`` of the set in ``base`` (the rules in shard.smk): its own, or
    when its stage's jobs are ``grouped`` (its rule runs groups of shards: ``shards_per_job`` > 1 somewhere), its
    group's of ``shards_per_job``."""
    shards = shard_job_shards(shard, shards_per_job, num_shards, grouped)
    if len(shards) == 1:
        return f"{base}/logs/split.{shard}.log", f"{base}/split.{shard}/done"
    first, last = shards
    return f"{base}/logs/shards.{first}-{last}.log", f"{base}/jobs/shards.{first}-{last}.done"


def shard_job_shards(shard: int, shards_per_job: int, num_shards: int, grouped: bool) -> tuple[int, ...]:
    """The shard wildcards of the job running ``shard`` (shard.smk): ``(shard,)``, or ``(first, last)`` of its
    group when its stage's jobs are ``grouped``."""
    if not grouped:
        return (shard,)
    first = shard // shards_per_job * shards_per_job
    return first, min(first + shards_per_job, num_shards) - 1
