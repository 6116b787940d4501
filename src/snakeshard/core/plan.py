"""Shard planning: cut a dataset's keys into contiguous, cost-balanced shards.

Shards are contiguous runs of the dataset in file order (as Kaldi's
split_scp.pl does), so merging in shard order reproduces the input order. The
cost of an item is its duration in seconds when sharding by seconds or when
every duration is known, else 1. Assignment depends only on the keys, costs and
the sharding config, so it is deterministic.

``ensure_plan`` runs while Snakemake parses the Snakefile (the shard count must
be known to build the DAG). It caches ``plan.json`` keyed by a signature of the
dataset files and the sharding config, so parsing stays cheap after the first time.
Beside the keys, a plan records per shard a digest of what its keys stand for
(``records``: their wav.scp, segments, text, utt2spk lines or JSON records) and,
in ``audio_files.json``, the audio files they read, whose identity is checked at
every parse (see fingerprint.py).

Each ``split.N/`` also gets ``items.json``, the shard's slice of the dataset (as Kaldi's
split_data.sh writes one data dir per split): key, where it was declared, audio, seconds and
fields of each of its items. A shard job's ``load_dataset`` reads that slice, so its memory and
start-up do not grow with the dataset (a 1M-key dataset is read once, here, not in every job).
"""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path

from snakeshard.core.data import source_spec
from snakeshard.core.fingerprint import digest, keys_digest, keys_text
from snakeshard.core.forked import map_forked, plan_workers
from snakeshard.core.manifest import scan_manifest
from snakeshard.core.shard_files import KEYS_FILE, SHARD_ITEMS
from snakeshard.errors import ConfigError, DataError
from snakeshard.io.atomic import atomic_write_json, atomic_write_text, write_if_changed

# 2: per-shard record digests and audio_files.json; 3: split.N/items.json; 4: its items and fields apart
PLAN_FORMAT = 4
AUDIO_FILES = "audio_files.json"  # beside plan.json: per shard, the audio files it reads
# the files of a Kaldi dir whose edit re-plans (spk2utt: only for its note, which a reused plan says again)
DATASET_FILES = ("wav.scp", "segments", "utt2dur", "reco2dur", "text", "utt2spk", "spk2utt", "feats.scp",
                 "utt2num_frames", "frame_shift")


# A stage that sets no sharding, whose runner declares none: 8 shards, several per core of a workstation, so a core
# that finishes its shards early takes another rather than idling while one long shard ends (PocketSphinx over 200
# utterances on 2 cores: 2 shards once ended 26 s apart; 8 shards took the time of two bare loops over the halves,
# median of 3 rounds, bench/RESULTS.md section 22). A fixed number, not one per core of the machine planning: a
# plan that followed the cores would re-cut every shard (and rerun every job) when the same project moves to a
# cluster or another workstation. At most 100,000 items a shard (more shards past 800,000 items): the planner holds
# one shard's slice at a time, ~1 KB a key while it is written (10,000,000 keys in 8 shards peaked at 1.35 GB in a
# planning process, 2.5 GB over all of them; bench/RESULTS.md section 32), and a killed job loses one shard's work.
DEFAULT_SHARDING = {"num_shards": 8, "max_shard_items": 100_000}


def split_contiguous(costs: list[float], num_shards: int) -> list[int]:
    """Start index of each of ``num_shards`` non-empty contiguous shards with near-equal cost.

    Shard s ends where the running cost first reaches (s + 1) / n of the total,
    keeping at least one item for each shard still to come.
    """
    n_items = len(costs)
    num_shards = max(1, min(num_shards, n_items))
    total = sum(costs)
    starts = [0]
    running = 0.0
    i = 0
    for s in range(num_shards - 1):
        target = total * (s + 1) / num_shards
        # take at least one item; stop before the target unless taking the item lands closer
        while True:
            running += costs[i]
            i += 1
            remaining_shards = num_shards - 1 - s
            if n_items - i <= remaining_shards:
                break
            if running >= target:
                break
            nxt = running + costs[i]
            if nxt > target and (nxt - target) > (target - running):
                break
        starts.append(i)
    return starts


def split_by_budget(costs: list[float], budget: float) -> list[int]:
    """Start indices of contiguous shards whose cost stays within ``budget`` (an item over it stands alone)."""
    starts = [0]
    running = 0.0
    for i, cost in enumerate(costs):
        if i > starts[-1] and running + cost > budget:
            starts.append(i)
            running = 0.0
        running += cost
    return starts


def sharding_mode(sharding: dict, where: str = "sharding") -> str:
    """The one of num_shards / shard_size / shard_seconds that ``sharding`` sets; a ConfigError naming ``where``
    otherwise, or for a max_shard_items beside shard_size or shard_seconds (which already size a shard)."""
    given = [k for k in ("num_shards", "shard_size", "shard_seconds") if sharding.get(k) is not None]
    if len(given) != 1:
        raise ConfigError(f"{where}: set exactly one of num_shards, shard_size, shard_seconds (got {given or 'none'})")
    if sharding.get("max_shard_items") is not None and given != ["num_shards"]:
        raise ConfigError(f"{where}.max_shard_items: only with num_shards ({given[0]} already sets how big a shard "
                          "is)")
    return given[0]


def shard_counts(manifest, sharding: dict) -> list[int]:
    """How many consecutive items of ``manifest`` each shard takes, by exactly one of num_shards / shard_size /
    shard_seconds; with ``keep_together``, boundaries fall only between groups (runs of one value of that field)."""
    mode = sharding_mode(sharding)
    n = manifest.num_items
    together = sharding.get("keep_together")
    groups = group_starts(manifest, together) if together else None
    if mode == "shard_size" and groups is None:
        return [min(int(sharding["shard_size"]), n - a) for a in range(0, n, int(sharding["shard_size"]))]
    if mode == "shard_seconds" or mode == "num_shards" and manifest.missing < n:
        # Some durations known, some not: read the missing ones from the audio headers rather than
        # silently cutting the whole plan by item counts (which moves every shard boundary).
        manifest.fill_durations()
    costs = manifest.seconds if mode != "shard_size" and not manifest.missing else array("d", [1.0]) * n
    if groups is not None:  # each group a unit, its cost its items' summed
        costs = [sum(costs[a:b]) for a, b in zip(groups, groups[1:] + [n])]
    if mode == "num_shards":
        num_shards = int(sharding["num_shards"])
        if sharding.get("max_shard_items"):  # more shards for a bigger dataset: about this many items at most
            num_shards = max(num_shards, -(-n // int(sharding["max_shard_items"])))
        starts = split_contiguous(costs, num_shards)
    else:  # a shard closes before the item (group) that would take it over its budget
        starts = split_by_budget(costs, float(sharding[mode]))
    if groups is not None:
        starts = [groups[s] for s in starts]
    return [b - a for a, b in zip(starts, starts[1:] + [n])]


def group_starts(manifest, field: str) -> list[int]:
    """The items where a new value of ``field`` starts (a speaker, a recording); a value met again after another is
    refused, naming both keys: a group must lie on consecutive lines, as Kaldi's split_data.sh wants speakers
    (utterance ids that start with their speaker's)."""
    starts, first_of, last = [], {}, None
    for i, (value, key, where) in enumerate(manifest.groups(field)):
        if value == last:
            continue
        if value in first_of:
            raise DataError(f"sharding.keep_together: {field} {value!r} of key {key!r} ({where}) comes back after "
                            f"other values (its first key: {first_of[value]}): keep_together needs the keys of one "
                            f"{field} on consecutive lines; sort the dataset by it (Kaldi: utterance ids that start "
                            "with their speaker's or recording's id)")
        first_of[value] = f"{key!r} ({where})"
        starts.append(i)
        last = value
    return starts


def input_signature(dataset: dict, sharding: dict) -> str:
    """Changes when the dataset's key files or the sharding config change (stat only: cheap)."""
    path = Path(source_spec(dataset)["path"])  # a chained dataset's keys come from its source
    files = [path / name for name in DATASET_FILES] if path.is_dir() else [path]
    stats = []
    for f in files:
        try:
            st = os.stat(f)
            stats.append([str(f), st.st_size, st.st_mtime_ns])
        except FileNotFoundError:
            pass
    payload = json.dumps([PLAN_FORMAT, dataset, sharding, stats], sort_keys=True)
    return digest(payload)


def make_plan(dataset: dict, sharding: dict, on_shard=None, cache_dir=None, previous: dict | None = None,
              collect: list | None = None, forked: bool = False) -> dict:
    """Read and validate the dataset, plan its shards: the plan record. ``on_shard(n, rows)`` is called with
    each shard's ``manifest.Rows`` as it is planned (``ensure_plan`` writes its files), and its return values
    are appended to ``collect`` in shard order; one shard's rows at a time are in memory. With ``cache_dir``, a
    JSON Lines manifest keeps its columns there and, when only appended to since, reads just its new lines;
    then the leading shards of ``previous`` (the plan before) that hold the same items are kept as they were,
    and ``on_shard`` is not called for them. ``forked``: a big manifest's shards are planned in forked processes
    (core/forked.py), where ``on_shard`` runs too: only its return values come back."""
    signature = input_signature(dataset, sharding)
    manifest = scan_manifest(dataset, cache_dir)
    counts = shard_counts(manifest, sharding)
    manifest.check_audio_field()  # after the durations: a key whose duration cannot be read is named first, as before
    known = not manifest.missing
    kept = _kept_shards(previous, counts, manifest, known)
    if cache_dir is not None:
        manifest.save(cache_dir, signature)
    first_item = sum(counts[:kept])
    workers = plan_workers(manifest.bytes_after(first_item)) if forked else 1

    def plan_shards(run: tuple[int, int, list[int]]) -> list[tuple[dict, object]]:
        first_shard, first, run_counts = run
        planned = []
        for n, rows in enumerate(manifest.shards(run_counts, first), first_shard):
            record = {
                "shard": n,
                "items": len(rows.keys),
                "seconds": rows.total_seconds() if known else None,
                "keys_digest": keys_digest(rows.keys),
                "records": rows.records_digests(),
                "first_key": rows.keys[0],
                "last_key": rows.keys[-1],
            }
            planned.append((record, on_shard(n, rows) if on_shard is not None else None))
        return planned

    records = previous["shards"][:kept] if kept else []
    for planned in map_forked(plan_shards, shard_runs(counts, kept, first_item, workers), workers):
        for record, value in planned:
            records.append(record)
            if collect is not None:
                collect.append(value)
    plan = {
        "format": PLAN_FORMAT,
        "dataset": dataset,
        "sharding": sharding,
        "signature": signature,
        "num_items": manifest.num_items,
        "total_seconds": round(sum(manifest.seconds), 3) if known else None,
        "num_shards": len(counts),
        "shards": records,
    }
    if manifest.notes:  # kept with the plan, so that a parse that reuses it says them again
        plan["notes"] = manifest.notes
    return plan


def shard_runs(counts: list[int], first_shard: int, first_item: int, runs: int) -> list[tuple[int, int, list[int]]]:
    """Shards ``first_shard`` on as up to ``runs`` runs of consecutive shards with near-equal item counts: each
    (its first shard, its first item, its shards' item counts)."""
    todo = counts[first_shard:]
    cuts = split_contiguous(todo, runs) if todo else []
    return [(first_shard + a, first_item + sum(todo[:a]), todo[a:b]) for a, b in zip(cuts, cuts[1:] + [len(todo)])]


def _kept_shards(previous: dict | None, counts: list[int], manifest, known: bool) -> int:
    """How many leading shards of ``previous`` (the plan before) stand as they were: that plan was made from the
    items the manifest read from its cache, each shard has the same item count, all within those items, and
    durations were known then as now."""
    if (not previous or previous["signature"] != manifest.reused_plan
            or (previous["total_seconds"] is not None) != known):
        return 0
    kept = end = 0
    for count, record in zip(counts, previous["shards"]):
        end += count
        if record["items"] != count or end > manifest.reused_items:
            break
        kept += 1
    return kept


def ensure_plan(set_dir: str | os.PathLike, dataset: dict, sharding: dict) -> dict:
    """The plan for one stage and dataset: reuse ``set_dir/plan.json`` if still valid, else plan anew.

    Re-planning rewrites a ``split.N/keys`` file only when its keys changed, so
    unchanged shards keep their mtime and are not rerun by Snakemake. A JSON Lines manifest that was only
    appended to is read from where the plan before stopped, and its unchanged leading shards are kept.
    """
    set_dir = Path(set_dir)
    plan_path = set_dir / "plan.json"
    previous = None
    try:
        plan = json.loads(plan_path.read_text())
        # os.path on strings, not Path objects: this runs at every parse, 10,000 checks at 10,000 shards
        if all(
            os.path.isfile(f"{set_dir}/split.{n}/{KEYS_FILE}") and os.path.isfile(f"{set_dir}/split.{n}/{SHARD_ITEMS}")
            for n in range(plan["num_shards"])
        ) and os.path.isfile(set_dir / AUDIO_FILES):
            if plan.get("signature") == input_signature(dataset, sharding):
                return plan
            if (plan.get("format"), plan.get("dataset"), plan.get("sharding")) == (PLAN_FORMAT, dataset, sharding):
                previous = plan  # its leading shards may stand
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        pass
    audio = []

    def write_shard(n, rows):  # called once the dataset is read and validated: a bad one leaves nothing here
        write_if_changed(set_dir / f"split.{n}" / KEYS_FILE, keys_text(rows.keys))  # a rule input: its mtime matters
        atomic_write_text(set_dir / f"split.{n}" / SHARD_ITEMS, rows.slice_text(), fsync=False)
        return rows.audio_files()

    plan = make_plan(dataset, sharding, on_shard=write_shard, cache_dir=set_dir, previous=previous, collect=audio,
                     forked=True)
    kept = plan["num_shards"] - len(audio)
    if kept:  # shards kept from the plan before keep their audio lists, read only now that some are kept
        try:
            before = read_audio_files(set_dir)
            if len(before) < kept:
                raise ValueError(f"{AUDIO_FILES} lists {len(before)} shards")
            audio[:0] = before[:kept]
        except (OSError, ValueError):  # unreadable (edited by hand): every shard is planned anew
            audio.clear()
            plan = make_plan(dataset, sharding, on_shard=write_shard, cache_dir=set_dir, collect=audio, forked=True)
    atomic_write_json(set_dir / AUDIO_FILES, audio, fsync=False)
    atomic_write_json(plan_path, plan)  # last: a plan.json on disk means its other files are written
    return plan


def read_audio_files(set_dir: str | os.PathLike) -> list[list[str]]:
    """Per shard, the audio files the plan in ``set_dir`` reads (written beside plan.json)."""
    return json.loads(Path(set_dir, AUDIO_FILES).read_text())


def overlapping_shards(upstream: dict, plan: dict) -> list[list[int]]:
    """Per shard of ``plan``, the shards of ``upstream`` that hold any of its keys. Both plans cut the same keys in
    the same order (a chained dataset's are its source's) into contiguous shards, so item counts locate them."""
    if upstream["num_items"] != plan["num_items"]:  # not the same keys: every shard depends on all of upstream
        return [list(range(upstream["num_shards"]))] * plan["num_shards"]
    ends, end = [], 0
    for shard in upstream["shards"]:
        end += shard["items"]
        ends.append(end)
    found, start, j = [], 0, 0
    for shard in plan["shards"]:
        stop = start + shard["items"]
        while ends[j] <= start:
            j += 1
        k = j
        while ends[k] < stop:
            k += 1
        found.append(list(range(j, k + 1)))
        start = stop
    return found


# shards_per_job: auto (the default) groups consecutive small shards into one job, so that a job's fixed cost (a
# Python process and its imports, ~25 ms of CPU, and Snakemake's ~10 ms per job; on SLURM, a submission: seconds)
# is paid over enough work. A job takes shards until it holds AUTO_ITEMS items or, when durations are known,
# AUTO_SECONDS of audio, and a set keeps at least AUTO_MIN_JOBS jobs (parallelism for small sets). Measured in
# bench/RESULTS.md (section 16): 1,000 one-key shards in 32 jobs take 0.2x the wall of 1,000 raw `echo` jobs.
AUTO = "auto"
AUTO_ITEMS = 32
AUTO_SECONDS = 60.0
AUTO_MIN_JOBS = 8


def shards_per_job(plan: dict, setting: int | str = AUTO) -> int:
    """How many consecutive shards of ``plan`` one job runs: ``setting`` when a number, else the ``auto`` rule
    above (from the shards' mean item count and duration)."""
    if setting != AUTO:
        return int(setting)
    n = plan["num_shards"]
    k = AUTO_ITEMS * n // max(plan["num_items"], 1)  # shards of that many items on average fill a job
    if plan.get("total_seconds"):
        k = min(k, int(AUTO_SECONDS * n // plan["total_seconds"]))
    return max(1, min(k, n // AUTO_MIN_JOBS))


def shards_text(n: int) -> str:
    """``1 shard``, ``2 shards``."""
    return f"{n} shard" if n == 1 else f"{n} shards"


def format_plan_table(plan: dict, title: str = "") -> str:
    """A human table: shard, items, seconds, first and last key."""
    rows = [f"{'shard':>6} {'items':>8} {'seconds':>10}  first_key .. last_key"]
    for s in plan["shards"]:
        secs = f"{s['seconds']:.1f}" if s["seconds"] is not None else "-"
        rows.append(f"{s['shard']:>6} {s['items']:>8} {secs:>10}  {s['first_key']} .. {s['last_key']}")
    total = f"{plan['total_seconds']:.1f}" if plan["total_seconds"] is not None else "-"
    rows.append(f"{'total':>6} {plan['num_items']:>8} {total:>10}  ({shards_text(plan['num_shards'])})")
    if plan["total_seconds"] is None:  # a user trial: "-" here and seconds for the same data in another stage
        rows.append("seconds -: not read (the dataset gives no durations, and this stage's sharding needs none)")
    head = [title] if title else []
    return "\n".join(head + rows)
