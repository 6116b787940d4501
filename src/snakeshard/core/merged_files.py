"""A set's merged output as files on disk: ``merged.json``, the record the merge writes last (what it was made
from, the files it wrote), read by status and every reader; and its removal when a shard of the set runs again."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from snakeshard.core.set_summary import SUMMARY_FILE


def merged_record(set_dir) -> dict | None:
    """A set's merged.json, or None when there is none (or it was cut short: the next run merges again)."""
    try:
        return json.loads(Path(set_dir, "merged.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def withdraw_merged(set_dir) -> None:
    """Remove a set's merged output as one of its shards runs again: the files its merged.json lists and the
    summary, then merged.json. A merged scp points into shard arks that the rerun rewrites or empties, and a Kaldi
    reader (kaldiio, ESPnet) does not ask merged.json first (a user trial read new values, and a failed shard's
    partial ark, through an old embedding.scp). Until the merge runs again, the set has no merged files. A kill in
    between leaves a merged.json whose files are gone, which the next parse removes (forget_incomplete_merge)."""
    record = merged_record(set_dir)
    if record is None:
        return
    inside = os.path.realpath(set_dir) + os.sep
    for name in [*(record.get("files") or ()), SUMMARY_FILE]:
        path = os.path.realpath(os.path.join(set_dir, name))
        if path.startswith(inside):  # a runner's own merge lists what it wrote
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # another shard job's removed it first
                os.unlink(path)
    Path(set_dir, "merged.json").unlink(missing_ok=True)
