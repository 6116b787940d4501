"""The files the plan writes into each ``split.N`` directory, and how a shard job reads them.

Apart from plan.py (which writes them) so that a shard job need not import the planner.
"""

from __future__ import annotations

import os

KEYS_FILE = "keys"  # the shard's keys, one per line (fingerprint.keys_text)
SHARD_ITEMS = "items.json"  # the shard's slice of the dataset: what load_dataset reads in the job (data.py)
CANARY_SPEC = ".spec.json"  # beside a canary's dir (<dir>.spec.json): the spec of a canary over a chained dataset


def read_keys_file(shard_dir: str | os.PathLike) -> tuple[list[str], bytes]:
    """The keys of ``shard_dir/keys`` (one per line, as ``keys_text`` writes them) and the file's bytes."""
    with open(os.path.join(shard_dir, KEYS_FILE), "rb") as f:
        raw = f.read()
    return raw.decode("utf-8").split("\n")[:-1], raw


def read_shard_keys(shard_dir: str | os.PathLike) -> list[str]:
    return read_keys_file(shard_dir)[0]
