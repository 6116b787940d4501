"""The planner as it was before it streamed (commit d07dd60): the whole dataset read as ``Item`` objects, then cut.
Kept as the oracle the streaming planner is compared with, byte for byte (tests/test_plan_streaming.py)."""

from __future__ import annotations

import json
from pathlib import Path

from snakeshard.core.data import JSONL_RECORD, check_audio_exists, fill_durations, is_pipe, read_items
from snakeshard.core.fingerprint import digest, keys_digest, keys_text
from snakeshard.core.plan import AUDIO_FILES, PLAN_FORMAT, input_signature, split_by_budget, split_contiguous
from snakeshard.core.shard_files import KEYS_FILE, SHARD_ITEMS


def plan_shards(items, sharding):
    mode = next(k for k in ("num_shards", "shard_size", "shard_seconds") if sharding.get(k) is not None)
    if mode == "shard_size":
        starts = list(range(0, len(items), int(sharding["shard_size"])))
    elif mode == "shard_seconds":
        fill_durations(items)
        starts = split_by_budget([i.seconds for i in items], float(sharding["shard_seconds"]))
    else:
        if any(i.seconds is not None for i in items):
            fill_durations(items)
        known = all(i.seconds is not None for i in items)
        starts = split_contiguous([i.seconds if known else 1.0 for i in items], int(sharding["num_shards"]))
    ends = starts[1:] + [len(items)]
    return [items[a:b] for a, b in zip(starts, ends)]


def records_digests(shard):
    lines = {}
    for item in shard:
        for name, value in item.records.items():
            lines.setdefault(name, []).append(f"{item.key}\t{value}\n")
    return {name: digest("".join(text)) for name, text in sorted(lines.items())}


def shard_items_text(items):
    encoder = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":"))
    head = encoder.encode([[i.key, i.source, i.audio, i.seconds] for i in items])
    written = [i.records.get(JSONL_RECORD) if i.records else None for i in items]
    fields = "[" + ",".join(written) + "]" if all(written) else encoder.encode([i.fields for i in items])
    return f'{{"items":{head},"fields":{fields}}}\n'


def reference_files(dataset: dict, sharding: dict) -> dict[str, bytes]:
    """What the old ensure_plan wrote for ``dataset``: {path relative to the set dir: bytes}."""
    items = read_items(dataset)
    check_audio_exists(items)
    shards = plan_shards(items, sharding)
    known = all(i.seconds is not None for i in items)
    files, records = {}, []
    for n, shard in enumerate(shards):
        keys = [i.key for i in shard]
        records.append({"shard": n, "items": len(keys),
                        "seconds": round(sum(i.seconds for i in shard), 3) if known else None,
                        "keys_digest": keys_digest(keys), "records": records_digests(shard),
                        "first_key": keys[0], "last_key": keys[-1]})
        files[f"split.{n}/{KEYS_FILE}"] = keys_text(keys).encode()
        files[f"split.{n}/{SHARD_ITEMS}"] = shard_items_text(shard).encode()
    audio = [list(dict.fromkeys(i.audio for i in s if i.audio and not is_pipe(i.audio))) for s in shards]
    files[AUDIO_FILES] = (json.dumps(audio, indent=1) + "\n").encode()
    plan = {"format": PLAN_FORMAT, "dataset": dataset, "sharding": sharding,
            "signature": input_signature(dataset, sharding), "num_items": len(items),
            "total_seconds": round(sum(i.seconds for i in items), 3) if known else None,
            "num_shards": len(shards), "shards": records}
    files["plan.json"] = (json.dumps(plan, indent=1) + "\n").encode()
    return files


def written_files(set_dir: Path) -> dict[str, bytes]:
    """The plan's files in ``set_dir`` (not the planner's own cache of a manifest's columns)."""
    return {str(p.relative_to(set_dir)): p.read_bytes() for p in sorted(set_dir.rglob("*"))
            if p.is_file() and p.relative_to(set_dir).parts[0] != "manifest_cache"}
