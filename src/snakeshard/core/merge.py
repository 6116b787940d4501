"""Merging shards: validate every ``done``, then concatenate fragments in plan order.

Nothing is merged unless every planned shard is done with the expected
fingerprint, item count and keys digest. Each per-key fragment must hold every
key of its shard exactly once. Outputs are written by rename, and
``merged.json`` last, so a crashed merge never looks complete.

``merged.json`` records the inputs it was made from (every shard's fingerprint).
Once the data, config or code change, the old merged files stay on disk until a
rerun replaces them, but they are stale: ``require_current`` refuses them, and
everything in snakeshard that reads a merged output goes through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import zlib
from pathlib import Path

from snakeshard.core.hooks import runner_name
from snakeshard.core.merged_files import merged_record
from snakeshard.core.set_summary import write_set_summary
from snakeshard.core.shard_files import (FINGERPRINTS_FILE, SET_SPEC, read_fingerprints, read_shard_keys, read_spec,
                                         shard_job_files)
from snakeshard.errors import MAX_LISTED, MergeError, SnakeshardError
from snakeshard.io.atomic import atomic_write_bytes, atomic_write_json, remove_temps_of

FIELDS_FILE = "fields.json"  # beside the merged files: per field, its format and index file
SHARD_ONLY_META = ("bytes", "crc32", "ark", "dir")  # per-shard parts of a field's meta
_ARK_OFFSET = re.compile(r":\d+(\[[^\]]*\])?$")  # kaldiio's "file.ark:123" (optionally "[0:10]")


class UnreadableDone(SnakeshardError):
    """A ``done`` file exists but is not a done record (cut short by a crash or power loss)."""


class StaleMergedOutput(SnakeshardError):
    """A merged output that was made from other inputs than the current plan's (or in another directory)."""


def holds_paths(files) -> bool:
    """True if any of these index files is an scp (``key path``): the default writers' ark, npy, wav and flac
    fields and a custom writer's ``*.scp``. Their paths are absolute, so a moved or copied project's point
    back at where it was made; text and JSON Lines move with the project."""
    return any(str(name).endswith(".scp") for name in files or ())


def made_elsewhere(recorded: str | None, here) -> bool:
    """True if ``recorded`` (the absolute dir a done or merged.json was written in) is not ``here``."""
    return recorded is not None and os.path.realpath(recorded) != os.path.realpath(here)


def done_moved(done: dict, shard_dir) -> bool:
    """True if the shard whose ``done`` this is was computed in another dir and its scp files point there."""
    return made_elsewhere(done.get("shard_dir"), shard_dir) and holds_paths(done.get("fragments"))


def moved_fix(stage: str) -> str:
    return f"recompute them here: snakemake --profile <your profile> --forcerun shard_{stage}"


def rerun_command(done_path) -> str:
    """The command that recomputes one shard whatever state its ``done`` is in (and then merges again).

    A shard run by a job of several (``shards_per_job``) is not a rule's output: its done goes, then its
    job is forced (the job skips its other shards, whose done still matches)."""
    done_path = Path(done_path)
    set_dir = done_path.parent.parent
    try:
        spec = read_spec(set_dir / SET_SPEC)
        k, grouped = spec.get("shards_per_job", 1), spec.get("grouped", False)
        num_shards = json.loads((set_dir / "plan.json").read_text())["num_shards"]
    except (OSError, ValueError, KeyError):
        grouped = False
    if not grouped:
        return f"snakemake --profile <your profile> --forcerun {done_path}"
    shard = int(done_path.parent.name.removeprefix("split."))
    job = shard_job_files(str(set_dir), shard, k, num_shards, grouped)[1]
    return f"rm -f {done_path} && snakemake --profile <your profile> --forcerun {job}"


def read_done(shard_dir: Path) -> dict | None:
    """The shard's done record; None if there is none; ``UnreadableDone`` naming the shard and the fix."""
    path = Path(shard_dir) / "done"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        done = json.loads(raw)
        if not isinstance(done, dict):
            raise ValueError(f"a JSON {type(done).__name__}, not an object")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        what = "empty (0 bytes)" if not raw else f"not a done record ({e})"
        raise UnreadableDone(f"{path} is {what}: a write cut short by a crash or power loss. "
                             f"Rerun the shard: {rerun_command(path)}") from None
    return done


def check_shards(set_dir: Path, plan: dict, shard_fps: list[str]) -> tuple[list[Path], list[dict]]:
    """The planned shard dirs and their ``done`` records, after checking each against the plan and its expected
    fingerprint."""
    shard_dirs, dones = [], []
    problems = []
    for shard, expected_fp in zip(plan["shards"], shard_fps):
        shard_dir = set_dir / f"split.{shard['shard']}"
        shard_dirs.append(shard_dir)
        try:
            done = read_done(shard_dir)
        except UnreadableDone as e:
            problems.append(f"shard {shard['shard']}: {e}")
            continue
        dones.append(done)
        if done is None:
            problems.append(f"shard {shard['shard']} is not done ({shard_dir}/done missing)")
        elif done.get("fingerprint") != expected_fp:
            problems.append(
                f"shard {shard['shard']} was computed with fingerprint {done.get('fingerprint')}, "
                f"expected {expected_fp} (its data, config, model or code changed since): rerun it"
            )
        elif done.get("items") != shard["items"] or done.get("keys_digest") != shard["keys_digest"]:
            problems.append(f"shard {shard['shard']}: done records {done.get('items')} items / keys "
                            f"{done.get('keys_digest')}, plan has {shard['items']} / {shard['keys_digest']}")
        elif done_moved(done, shard_dir):
            problems.append(f"shard {shard['shard']} was computed in {done['shard_dir']} (the project was moved or "
                            f"copied since): its scp files point there; {moved_fix(set_dir.parent.name)}")
        else:
            problems.extend(_state_file_problems(shard_dir, done))
    if problems:
        raise MergeError(f"refusing to merge {set_dir}: " + "; ".join(problems[:MAX_LISTED]))
    return shard_dirs, dones


def _state_file_problems(shard_dir: Path, done: dict) -> list[str]:
    """The shard's ``finalize_state`` files that are gone or no longer what it wrote (size, CRC-32)."""
    problems = []
    for name, meta in (done.get("state_files") or {}).items():
        path = shard_dir / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            problems.append(f"{path}: missing (its done lists it): rerun the shard: {rerun_command(shard_dir / 'done')}")
            continue
        if len(data) != meta["bytes"] or zlib.crc32(data) != meta["crc32"]:
            problems.append(f"{path}: changed since its shard wrote it ({len(data)} bytes, done records "
                            f"{meta['bytes']}, or another CRC-32): rerun the shard: {rerun_command(shard_dir / 'done')}")
    return problems


def _in_plan_order(lines: list[str], keys: list[str], where: str) -> list[str]:
    """``lines`` (``key ...``) in the order of ``keys``, after checking each key is there exactly once."""
    got = [line.split(" ", 1)[0] for line in lines]
    if got == keys:
        return lines
    seen = set()
    dupes = [k for k in got if k in seen or seen.add(k)]
    if dupes:
        raise MergeError(f"{where}: duplicate key(s) {dupes[:MAX_LISTED]}")
    planned = set(keys)
    unexpected = [k for k in got if k not in planned]
    if unexpected:
        raise MergeError(f"{where}: line(s) with unplanned key(s) {unexpected[:MAX_LISTED]} "
                         "(a value with a newline splits into such lines)")
    missing = [k for k in keys if k not in seen]
    if missing:
        raise MergeError(f"{where}: missing key(s) {missing[:MAX_LISTED]} of {len(missing)}")
    # same keys, another order (a custom writer, an unordered pool): merged outputs follow the plan
    by_key = dict(zip(got, lines))
    return [by_key[k] for k in keys]


def _absolute_scp(lines: list[str], where: str) -> str:
    """``lines`` of an scp fragment with every path made absolute, after checking it exists.

    Merged scp files are read from anywhere (a training recipe's own directory, another
    stage, kaldiio.load_scp in a notebook), so their paths are absolute, as in Kaldi's and
    ESPnet's dump directories. Relative paths in fragments are taken from the working
    directory, where the shard jobs ran. Pipes (``cmd |``) are left as they are.
    """
    out = []
    for line in lines:
        key, _, value = line.partition(" ")
        if value.endswith("|"):
            out.append(line)
            continue
        suffix = _ARK_OFFSET.search(value)
        path = value[:suffix.start()] if suffix else value
        if not os.path.exists(path):
            raise MergeError(f"{where}: key {key!r} points at {path}, which does not exist "
                             f"(relative scp paths are taken from the working directory {os.getcwd()})")
        out.append(f"{key} {os.path.abspath(path)}{suffix.group(0) if suffix else ''}")
    return "".join(line + "\n" for line in out)


def merge_fragments(shard_dirs: list[Path], output_dir: Path) -> list[str]:
    """Concatenate each per-key index file named in the shards' ``done`` files, in shard order.

    Fields written by the default writers (``done["fields"]``) were checked in their shard (every key
    exactly once, in plan order); here each index must still be byte for byte what was checked (size
    and CRC-32), the files it points at must exist, and a sample of ark records must read. Other
    fragments (custom writers) are checked line by line. Writes ``fields.json`` (what each field is).
    """
    dones = [read_done(d) for d in shard_dirs]
    names: list[str] = []
    for done in dones:
        for name in done.get("fragments", []):
            if name not in names:
                names.append(name)
    fields = _merged_fields(shard_dirs, dones)
    # A text field named like an scp file holds paths the user wrote: it takes the path checks below.
    by_index = {meta["index"]: field for field, meta in fields.items()
                if not (meta["format"] == "text" and field.endswith(".scp"))}
    shard_keys = None
    for name in names:
        if name in by_index:
            parts = [_checked_index(d, done, by_index[name]) for d, done in zip(shard_dirs, dones)]
        else:
            shard_keys = shard_keys or [read_shard_keys(d) for d in shard_dirs]
            parts = [_checked_lines(d, name, keys).encode() for d, keys in zip(shard_dirs, shard_keys)]
        target = Path(output_dir) / name
        target.parent.mkdir(exist_ok=True)  # a grouped field's dir ("collect_feats/feats.scp")
        atomic_write_bytes(target, parts)  # written part by part: no joined copy
    if fields:
        atomic_write_json(Path(output_dir) / FIELDS_FILE, fields)
        names.append(FIELDS_FILE)
    return names


def _merged_fields(shard_dirs: list[Path], dones: list[dict]) -> dict:
    """Field -> {format, index, options} over all shards; shards must agree on each field's format."""
    fields: dict[str, dict] = {}
    first: dict[str, Path] = {}
    for shard_dir, done in zip(shard_dirs, dones):
        for field, meta in (done.get("fields") or {}).items():
            public = {k: v for k, v in meta.items() if k not in SHARD_ONLY_META}
            if field not in fields:
                fields[field], first[field] = public, shard_dir
            elif fields[field] != public:
                raise MergeError(f"field {field!r} is {public} in {shard_dir} but {fields[field]} in {first[field]}: "
                                 "a field must have one type and format in every shard (its first key decides)")
    for shard_dir, done in zip(shard_dirs, dones):
        missing = sorted(set(fields) - set(done.get("fields") or {}))
        if missing:
            raise MergeError(f"{shard_dir}: no field {missing[0]!r}, which {first[missing[0]]} wrote")
    return fields


def _checked_index(shard_dir: Path, done: dict, field: str) -> bytes:
    """A default writer's index fragment, after checking it is what its shard wrote and points at real files."""
    meta = done["fields"][field]
    path = shard_dir / meta["index"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MergeError(f"{path}: fragment missing (its done lists it)") from None
    if len(data) != meta["bytes"]:
        changed = f"{len(data)} bytes, not the {meta['bytes']} bytes its shard wrote"
    elif zlib.crc32(data) != meta["crc32"]:
        changed = "its content changed since its shard wrote it (its CRC-32 is not the one in done)"
    else:
        changed = None
    if changed:
        raise MergeError(f"{path}: {changed}: rerun the shard: {rerun_command(shard_dir / 'done')}")
    if "ark" in meta:
        _check_ark_sample(path, data, meta["ark"])
    elif "dir" in meta:
        for line in data.decode("utf-8").split("\n")[:-1]:
            key, _, file = line.partition(" ")
            if not os.path.exists(file):
                raise MergeError(f"{path}: key {key!r} points at {file}, which does not exist")
    return data


def _check_ark_sample(index: Path, data: bytes, ark: str) -> None:
    """The ark exists, and its first, middle and last records read (kaldiio) at their recorded offsets."""
    import kaldiio

    if not os.path.exists(ark):
        raise MergeError(f"{index}: its ark {ark} does not exist")
    for line in {_line_at(data, 0), _line_at(data, len(data) // 2), _line_at(data, len(data) - 1)} if data else ():
        key, _, value = line.decode("utf-8").partition(" ")
        try:
            kaldiio.load_mat(value)
        except Exception as e:  # kaldiio raises ValueError, struct.error, EOFError, ... on a bad offset
            raise MergeError(f"{index}: key {key!r}: no readable record at {value} ({type(e).__name__}: {e}): "
                             f"rerun the shard: {rerun_command(index.parent / 'done')}") from None


def _line_at(data: bytes, pos: int) -> bytes:
    """The line of ``data`` (newline-terminated lines) that holds byte ``pos``, without its newline."""
    start = data.rfind(b"\n", 0, pos) + 1
    return data[start:data.index(b"\n", pos)]


def _checked_lines(shard_dir: Path, name: str, keys: list[str]) -> str:
    """A fragment no default writer checked: every planned key exactly once, in plan order; scp paths made absolute."""
    where = f"{shard_dir}/{name}"
    try:
        text = (shard_dir / name).read_bytes().decode("utf-8")  # lines end at "\n" only (no universal newlines)
    except FileNotFoundError:
        raise MergeError(f"{where}: fragment missing (other shards wrote {name!r})") from None
    lines = text.split("\n")
    if lines[-1] != "":
        raise MergeError(f"{where}: last line is not newline-terminated (truncated write?)")
    lines.pop()
    lines = _in_plan_order(lines, keys, where)
    if name.endswith(".scp"):
        return _absolute_scp(lines, where)
    return "".join(line + "\n" for line in lines)


def merge_set(set_dir: Path, plan: dict, fingerprints: dict, runner_cls) -> dict:
    """Validate all shards of one stage/dataset, let the runner merge them, record ``merged.json``.

    ``fingerprints`` is what the parse computed (shard_files.FINGERPRINTS_FILE): the stage fingerprint,
    each shard's expected one, and their digest, which merged.json records as its inputs.
    """
    set_dir = Path(set_dir)
    # A merge run by hand (outside Snakemake, which deletes outputs first) must not leave an old
    # merged.json claiming completeness over files this merge may fail halfway through rewriting.
    (set_dir / "merged.json").unlink(missing_ok=True)
    shard_fps = [entry["fingerprint"] for entry in fingerprints["shards"]]
    if len(shard_fps) != plan["num_shards"]:
        raise MergeError(f"refusing to merge {set_dir}: {len(shard_fps)} shard fingerprints for "
                         f"{plan['num_shards']} planned shards (plan and fingerprints out of step: rerun snakemake)")
    shard_dirs, dones = check_shards(set_dir, plan, shard_fps)
    files = _merged_files(runner_cls, runner_cls.merge(shard_dirs, set_dir), set_dir)
    summary = write_set_summary(set_dir, set_dir.parent.name, set_dir.name, plan, dones)
    record = {"items": plan["num_items"], "shards": plan["num_shards"], "fingerprint": fingerprints["stage"],
              "inputs": fingerprints["inputs"], "files": list(files), "set_dir": os.path.abspath(set_dir)}
    atomic_write_json(set_dir / "merged.json", record)
    for name in [*record["files"], summary, "merged.json"]:  # what a merge killed before its renames left
        remove_temps_of(set_dir / name)
    return record


def _merged_files(runner_cls, returned, set_dir: Path) -> list[str]:
    """What a runner's ``merge`` returned, checked: the names (in ``set_dir``) of the files it wrote, which
    merged.json lists, and by which status, the readers and a shard's rerun know the merged output. ESPnet3's merge
    returns ``{}``: taken at its word, its merged file was tracked by nothing (a user trial removed it, and status
    still said current)."""
    hook = f"{runner_name(runner_cls)}.merge"
    if not (isinstance(returned, (list, tuple)) and all(isinstance(name, str) for name in returned)):
        raise MergeError(f"{hook} returned {returned!r}: it returns the list of the names of the files it wrote in "
                         f"{set_dir} (merged.json lists them; [] if it wrote none)")
    missing = [name for name in returned if not (set_dir / name).is_file()]
    if missing:
        raise MergeError(f"{hook} returned {missing[:MAX_LISTED]}, which {set_dir} does not hold")
    return list(returned)


def remove_unplanned_shards(set_dir: Path, num_shards: int) -> list[int]:
    """Remove the ``split.N`` directories (and their logs) numbered past the plan: an earlier plan of more shards
    (a smaller ``shard_size``, fewer keys) left them, nothing reads them, and a feature stage's hold gigabytes.
    Called after the merge has succeeded, so a failed run keeps every file it had. Returns their numbers."""
    removed = []
    for entry in os.scandir(set_dir):
        number = entry.name.removeprefix("split.")
        if entry.is_dir() and number != entry.name and number.isdigit() and int(number) >= num_shards:
            if entry.is_symlink():  # the user put it elsewhere (scratch): the link goes, what it points to stays
                os.unlink(entry.path)
            else:
                shutil.rmtree(entry.path)
            Path(set_dir, "logs", f"split.{number}.log").unlink(missing_ok=True)
            removed.append(int(number))
    return sorted(removed)


def remove_unused_job_files(set_dir: Path, num_shards: int, shards_per_job: int, grouped: bool) -> list[str]:
    """Remove the done files and logs of jobs of several shards (``jobs/shards.A-B.done``, ``logs/shards.A-B.log``)
    that the set's current grouping does not make: an earlier ``shards_per_job``, or an earlier plan, left them
    (a user trial found them after fewer shards). Called after the merge has succeeded. Returns their names."""
    base = str(set_dir)
    kept = {name for n in range(num_shards) for name in shard_job_files(base, n, shards_per_job, num_shards, grouped)}
    removed = []
    for directory, suffix in (("jobs", "done"), ("logs", "log")):
        pattern = re.compile(rf"shards\.\d+-\d+\.{suffix}")
        try:
            entries = list(os.scandir(Path(set_dir, directory)))
        except FileNotFoundError:
            continue
        for entry in entries:
            if pattern.fullmatch(entry.name) and f"{base}/{directory}/{entry.name}" not in kept:
                os.unlink(entry.path)
                removed.append(f"{directory}/{entry.name}")
    with contextlib.suppress(OSError):  # empty now: a set whose shards run one a job has no jobs/ dir
        os.rmdir(Path(set_dir, "jobs"))
    return sorted(removed)


def moved_from(set_dir, record: dict) -> str | None:
    """Where a merged set whose scp files point into another directory was made (None: not moved, or
    nothing in it holds a path)."""
    made = record.get("set_dir")
    return made if made_elsewhere(made, set_dir) and holds_paths(record.get("files")) else None


def require_current_shards(set_dir, shards: range, upstream: str) -> list[str]:
    """The dirs of ``set_dir``'s shards ``shards`` (an upstream stage's, holding a chained shard's keys), after
    checking their ``done`` files hold the fingerprints whose digest is ``upstream`` (that shard's fingerprint part);
    else an error saying they are missing, stale or moved. A chained shard job reads its keys' upstream output from
    these shard dirs, not from the merge (so that only the shards over changed keys rerun)."""
    from snakeshard.core.fingerprint import inputs_digest

    dirs = [os.path.join(set_dir, f"split.{n}") for n in shards]
    dones = [read_done(d) for d in dirs]
    missing = [d for d, done in zip(dirs, dones) if done is None]
    if missing:
        raise StaleMergedOutput(f"{missing[0]} is not done (no done file): the upstream stage has not computed "
                                "this shard's keys; run snakemake")
    moved = next((d for d, done in zip(dirs, dones) if done_moved(done, d)), None)
    if moved:
        raise StaleMergedOutput(f"{moved} was computed in {dones[dirs.index(moved)]['shard_dir']} (the project was "
                                f"moved or copied since): its scp files point there; {moved_fix(Path(set_dir).parent.name)}")
    if inputs_digest([done.get("fingerprint") for done in dones]) != upstream:
        raise StaleMergedOutput(
            f"{set_dir}: the output of split.{shards.start}..split.{shards.stop - 1} is stale: made from other inputs "
            "than the current plan (data, config or code changed, and the rerun has not redone them yet; "
            "`snakeshard status` shows which shards are not done): refusing to read it")
    return dirs


def require_current(set_dir, inputs: str | None = None) -> dict:
    """``set_dir``'s merged.json if it was made from ``inputs`` (the current plan's digest; by default, the one
    the last snakemake parse wrote to the set's fingerprints.json), here; else an error saying the merged files
    there are missing (no merged.json, or a file it lists is gone), stale or moved. Every reader of merged output
    calls this first (``snakeshard.require_current`` for your own code, e.g. a rule of yours after the merge)."""
    if inputs is None:
        fingerprints = read_fingerprints(set_dir)
        if fingerprints is None:
            raise StaleMergedOutput(f"{set_dir}: no {FINGERPRINTS_FILE} (a set's dir under output_dir is given one "
                                    "at each snakemake parse): not a stage's set, or snakemake has not run")
        inputs = fingerprints["inputs"]
    record = merged_record(set_dir)
    if record is None:
        raise StaleMergedOutput(f"{set_dir} is not merged (no merged.json): run snakemake first")
    made = moved_from(set_dir, record)
    if made:
        raise StaleMergedOutput(f"{set_dir} was merged in {made} (the project was moved or copied since): its scp "
                                f"files point there; {moved_fix(Path(set_dir).parent.name)}")
    if record.get("inputs") != inputs:
        raise StaleMergedOutput(
            f"{set_dir}: the merged output is stale: it was made from other inputs than the current plan "
            "(data, config or code changed, and the rerun has not merged yet; `snakeshard status` shows "
            "which shards are not done): refusing to read it")
    missing = missing_merged_files(set_dir, record)
    if missing:
        raise StaleMergedOutput(f"{set_dir}: merged file(s) {', '.join(missing[:MAX_LISTED])} missing (its "
                                f"merged.json lists them): refusing to read it; {remerge_fix(set_dir)}")
    return record


def missing_merged_files(set_dir, record: dict) -> list[str]:
    """The files ``record`` (a merged.json) lists that are no longer in ``set_dir`` (deleted or moved away after
    the merge): one stat per merged file, never one per shard."""
    return [name for name in record.get("files") or () if not os.path.exists(os.path.join(set_dir, name))]


def forget_incomplete_merge(set_dir) -> list[str]:
    """At parse (the main Snakemake process): when files ``set_dir``'s merged.json lists are gone, remove that
    merged.json, so that Snakemake, finding the merge's output missing, merges the set again from its shards (and
    reruns what reads it) instead of calling it up to date. Returns the missing files (empty: nothing done).

    A merged.json claims its files are there; one that no longer holds is no record (as a merge run by hand
    removes it first). Costs a read of merged.json and one stat per merged file, none per shard."""
    record = merged_record(set_dir)
    missing = missing_merged_files(set_dir, record) if record else []
    if missing:
        Path(set_dir, "merged.json").unlink(missing_ok=True)
    return missing


def remerge_fix(set_dir) -> str:
    """What merges a set again from its shards (still on disk) when its merged files were removed: the next
    snakemake parse removes such a merged.json (forget_incomplete_merge), and Snakemake reruns a job whose output
    is missing."""
    return f"run snakemake again: it merges {set_dir} again from its shards"
