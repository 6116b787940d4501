"""The streaming planner (core/manifest.py) writes exactly what the planner that read whole datasets wrote
(tests/reference_plan.py, the code of d07dd60): plan.json, split.N/keys, split.N/items.json and
audio_files.json, byte for byte, on the shipped datasets and on JSON Lines manifests cut into many blocks;
and a bad manifest fails with the same message, naming the same file and line."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import pytest

from reference_plan import reference_files, written_files
from snakeshard.core import manifest
from snakeshard.core.plan import ensure_plan
from snakeshard.errors import ConfigError, DataError, SnakeshardError

PROJECT = Path(__file__).resolve().parents[1]
DEMO = PROJECT / "data/demo"
WAVS = sorted(str(p) for p in (DEMO / "wav").glob("*.wav"))
SHARDINGS = [{"num_shards": 1}, {"num_shards": 3}, {"num_shards": 7}, {"shard_size": 4}, {"shard_seconds": 6}]


def same_as_reference(tmp_path: Path, dataset: dict, sharding: dict) -> None:
    set_dir = tmp_path / f"set-{len(list(tmp_path.iterdir()))}"
    ensure_plan(set_dir, dataset, sharding)
    expected = reference_files(dataset, sharding)
    written = written_files(set_dir)
    assert sorted(written) == sorted(expected)
    for name in expected:
        assert written[name] == expected[name], name


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_shipped_kaldi_datasets_plan_as_before(tmp_path, sharding):
    for path in [DEMO, PROJECT / "data/demo_split/train", PROJECT / "data/demo_split/valid"]:
        same_as_reference(tmp_path, {"path": str(path), "format": "kaldi", "name": path.name}, sharding)


def same_error_as_reference(set_dir: Path, spec: dict, sharding: dict) -> str:
    """The DataError message planning ``spec`` gives, checked equal to the old planner's; nothing written."""
    with pytest.raises(DataError) as old:
        reference_files(spec, sharding)
    with pytest.raises(DataError) as new:
        ensure_plan(set_dir, spec, sharding)
    assert str(new.value) == str(old.value)
    assert not set_dir.exists()
    return str(new.value)


def varied_manifest(path: Path, n: int, seed: int = 0) -> dict:
    """n records as users write them: blank and CRLF lines, non-ASCII keys and text, int, float, string and
    missing durations (a missing one has audio to read it from), extra fields, keys of many lengths."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        record = {"id": f"spk{i % 7}-utt{i:05d}" + ("-ü" if i % 11 == 0 else "") + ('"\\' if i % 17 == 0 else ""),
                  "audio": WAVS[i % len(WAVS)],
                  "text": "höre " * rng.randrange(0, 30), "lang": rng.choice(["de", "en", None])}
        choice = i % 5
        if choice == 0:
            record["dur"] = rng.randrange(1, 9)  # int seconds
        elif choice == 1:
            record["dur"] = str(round(rng.uniform(0.5, 9), 2))  # a number as a string: read as one
        elif choice != 4:
            record["dur"] = round(rng.uniform(0.5, 9), 3)
        lines.append(json.dumps(record, ensure_ascii=i % 2 == 0))
        if i % 13 == 0:
            lines.append("   ")  # blank: skipped, but counted in line numbers
    text = "\n".join(lines).replace("\n", "\r\n", 3) + "\n\n"
    path.write_text(text, encoding="utf-8")
    return {"path": str(path), "format": "jsonl", "key_field": "id", "duration_field": "dur", "name": "varied"}


@pytest.mark.parametrize("block_bytes", [manifest.BLOCK_BYTES, 4096, 200])
def test_jsonl_manifests_plan_as_before_in_any_blocks(tmp_path, monkeypatch, block_bytes):
    """Blocks of 1 MB (one), 4 KB (tens), 200 bytes (a line often longer than a block)."""
    monkeypatch.setattr(manifest, "BLOCK_BYTES", block_bytes)
    odd = tmp_path / 'a "quoted" {braced} dir'  # the file's path is in every item's source: escaped as JSON
    odd.mkdir()
    spec = varied_manifest(odd / "varied.jsonl", 600)
    for sharding in SHARDINGS:
        same_as_reference(tmp_path, spec, sharding)
    # every duration given, none given, and no audio at all
    full = tmp_path / "full.jsonl"
    full.write_text("".join(json.dumps({"key": f"k{i}", "duration": 0.25 + i % 9}) + "\n" for i in range(500)))
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"key": f"k{i}", "audio": WAVS[i % 10]}) + "\n" for i in range(50)))
    for spec in [{"path": str(full), "format": "jsonl"}, {"path": str(bare), "format": "jsonl"}]:
        for sharding in SHARDINGS[:4] + ([SHARDINGS[4]] if spec["path"] == str(bare) else []):
            same_as_reference(tmp_path, spec, sharding)


def test_keys_whose_hashes_collide_are_told_apart(tmp_path, monkeypatch):
    """Duplicates are found among 64-bit hashes of the keys; keys that share a hash (forced here: the hash is
    the key's length) are compared as keys: distinct ones plan as before, real duplicates fail as before."""
    monkeypatch.setattr(manifest, "hash", len, raising=False)
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"key": f"k{i:03d}", "duration": 1.0}) + "\n" for i in range(40)))
    same_as_reference(tmp_path, {"path": str(path), "format": "jsonl"}, {"num_shards": 4})
    with open(path, "a") as f:
        f.write('{"key": "k007", "duration": 2}\n{"key": "k001", "duration": 2}\n{"key": "k007", "duration": 2}\n')
    with pytest.raises(DataError) as new:
        ensure_plan(tmp_path / "dupes", {"path": str(path), "format": "jsonl"}, {"num_shards": 4})
    with pytest.raises(DataError) as old:
        reference_files({"path": str(path), "format": "jsonl"}, {"num_shards": 4})
    assert str(new.value) == str(old.value)
    assert str(new.value).startswith(f"3 duplicate key(s): 'k007' ({path}:41, first at {path}:8), 'k001'")
    assert not (tmp_path / "dupes").exists()  # nothing written for a bad dataset


BAD_LINES = {
    "not JSON": '{"key": "x", "duration": ',
    "two values": '{"key": "x"} {"key": "y"}',
    "an array": '["x"]',
    "no key": '{"id": "x"}',
    "a number key": '{"key": 7}',
    "a list audio": '{"key": "x", "audio": ["a.wav"]}',
    "zero duration": '{"key": "x", "duration": 0}',
    "negative duration": '{"key": "x", "duration": -1.5}',
    "infinite duration": '{"key": "x", "duration": 1e999}',
    "text duration": '{"key": "x", "duration": "long"}',
    "a space in the key": '{"key": "x y", "duration": 1}',
    "an empty key": '{"key": "", "duration": 1}',
    "a control character in the key": '{"key": "x\\u001b", "duration": 1}',
    "a NBSP in the key": '{"key": "x\\u00a0y", "duration": 1}',
    "missing audio": '{"key": "x", "audio": "/nonexistent/x.wav", "duration": 1}',
    "no duration and a pipe": '{"key": "x", "audio": "sox a.wav -t wav - |"}',
}


@pytest.mark.parametrize("what", sorted(BAD_LINES))
@pytest.mark.parametrize("block_bytes", [manifest.BLOCK_BYTES, 300])
@pytest.mark.parametrize("workers", ["1", "3"])
def test_a_bad_record_fails_as_before_naming_file_and_line(tmp_path, monkeypatch, what, block_bytes, workers):
    """Each bad record, at line 62 of 80 (after a blank line), in one block or many, planned in one process or in
    three forked ones (a worker that meets it hands the manifest back to the driver): the same DataError the old
    planner gave, and nothing written."""
    monkeypatch.setattr(manifest, "BLOCK_BYTES", block_bytes)
    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", workers)
    lines = [json.dumps({"key": f"k{i:02d}", "duration": 1.5}) for i in range(79)]
    lines.insert(10, "")
    lines.insert(61, BAD_LINES[what])
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    spec = {"path": str(path), "format": "jsonl"}
    assert f"{path}:62" in same_error_as_reference(tmp_path / "set", spec, {"shard_seconds": 10})


@pytest.mark.parametrize("content, where", [(b"", "empty"), (b"\n  \n\n", "blank lines only"),
                                            (b'{"key": "a"}\n{"key": "b\xe9"}\n', "latin-1 byte")])
@pytest.mark.parametrize("workers", ["1", "3"])
def test_empty_or_undecodable_manifests_fail_as_before(tmp_path, monkeypatch, content, where, workers):
    """In one process and forked (an empty file there failed with `OSError: Invalid argument` until 2026-11-26)."""
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 8)
    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", workers)
    path = tmp_path / "m.jsonl"
    path.write_bytes(content)
    spec = {"path": str(path), "format": "jsonl", "name": "m"}
    with pytest.raises(DataError) as old:
        reference_files(spec, {"num_shards": 2})
    with pytest.raises(DataError) as new:
        ensure_plan(tmp_path / "set", spec, {"num_shards": 2})
    assert str(new.value) == str(old.value), where


def test_durations_are_summed_as_before(tmp_path):
    """Shard and total seconds are rounded sums in file order: the same float additions, the same digits."""
    rng = random.Random(3)
    durations = [rng.uniform(0.1, 30) for _ in range(3000)]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"key": f"u{i}", "duration": d}) + "\n" for i, d in enumerate(durations)))
    same_as_reference(tmp_path, {"path": str(path), "format": "jsonl"}, {"num_shards": 9})
    plan = json.loads((tmp_path / "set-1/plan.json").read_text())
    assert plan["total_seconds"] == round(sum(durations), 3) and not math.isnan(plan["total_seconds"])


def test_many_bad_keys_across_blocks_are_counted_and_the_first_five_listed_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 100)
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"key": f"k {i}" if i % 3 == 0 else f"k{i}"}) + "\n" for i in range(20)))
    with pytest.raises(DataError) as old:
        reference_files({"path": str(path), "format": "jsonl"}, {"num_shards": 2})
    with pytest.raises(DataError) as new:
        ensure_plan(tmp_path / "set", {"path": str(path), "format": "jsonl"}, {"num_shards": 2})
    assert str(new.value) == str(old.value) and str(new.value).startswith("7 key(s)")


# -- a manifest appended to: only its new lines are read -------------------------------------------

def parsed_lines(monkeypatch) -> list[int]:
    """Counts the manifest lines pass 1 parses (one entry per block)."""
    counted = []
    parse = manifest.JsonlManifest._parse_block

    def counting(self, numbers, lines):
        counted.append(len(lines))
        return parse(self, numbers, lines)

    monkeypatch.setattr(manifest.JsonlManifest, "_parse_block", counting)
    return counted


def lines_of(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"key": f"u{i:04d}", "duration": 0.5 + i % 7, "text": "ab" * (i % 5)}) + "\n"
                   + ("\n" if i % 9 == 0 else "") for i in range(start, start + n))


@pytest.mark.parametrize("block_bytes", [manifest.BLOCK_BYTES, 300])
@pytest.mark.parametrize("sharding", SHARDINGS[:4])
def test_an_appended_manifest_reads_only_its_new_lines_and_plans_as_if_read_whole(tmp_path, monkeypatch, block_bytes,
                                                                                    sharding):
    monkeypatch.setattr(manifest, "BLOCK_BYTES", block_bytes)
    path = tmp_path / "m.jsonl"
    path.write_text(lines_of(200))
    spec = {"path": str(path), "format": "jsonl"}
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, sharding)
    before = {p: p.stat().st_mtime_ns for p in set_dir.glob("split.*/*")}
    counted = parsed_lines(monkeypatch)
    with open(path, "a") as f:
        f.write(lines_of(57, 200))
    ensure_plan(set_dir, spec, sharding)
    assert sum(counted) == 57  # the 200 lines before were not parsed again
    expected = reference_files(spec, sharding)
    assert written_files(set_dir) == expected
    if "shard_size" in sharding:  # the full shards before the append are kept as they were: not even rewritten
        kept = [p for p in before if int(p.parent.name.split(".")[1]) < 200 // sharding["shard_size"]]
        assert kept and all(p.stat().st_mtime_ns == before[p] for p in kept)


@pytest.mark.parametrize("change", ["an edited line", "no newline at the end before", "shorter", "a cut-short cache",
                                    "another key field"])
def test_a_manifest_changed_otherwise_is_read_whole(tmp_path, monkeypatch, change):
    """Anything but whole lines appended, or a cache that cannot be read: the manifest is read from the start."""
    path = tmp_path / "m.jsonl"
    text = lines_of(120)
    if change == "no newline at the end before":
        text = text.rstrip("\n")
    path.write_text(text)
    spec = {"path": str(path), "format": "jsonl"}
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"num_shards": 4})
    counted = parsed_lines(monkeypatch)
    if change == "an edited line":
        path.write_text(text.replace('"u0003"', '"u0003x"') + lines_of(5, 120))
    elif change == "no newline at the end before":
        path.write_text(text + "\n" + lines_of(5, 120))
    elif change == "shorter":
        path.write_text(lines_of(100))
    elif change == "a cut-short cache":
        seconds = set_dir / "manifest_cache/seconds.f64"
        seconds.write_bytes(seconds.read_bytes()[:-8])
        path.write_text(text + lines_of(5, 120))
    else:
        path.write_text(text.replace('"key"', '"id"') + lines_of(5, 120).replace('"key"', '"id"'))
        spec = {**spec, "key_field": "id"}
    ensure_plan(set_dir, spec, {"num_shards": 4})
    assert sum(counted) == len([line for line in path.read_text().splitlines() if line.strip()])
    assert written_files(set_dir) == reference_files(spec, {"num_shards": 4})


@pytest.mark.parametrize("tail, message", [
    ('{"key": "u0007", "duration": 1}\n', "1 duplicate key(s): 'u0007' ({path}:{line}, first at {path}:9)"),
    ('{"key": "new", "duration": 0}\n', "{path}:{line}: 'duration' of 'new' is 0"),
    ('{"key": "a b", "duration": 1}\n', "1 key(s) are empty or contain whitespace or control characters: 'a b' "
                                        "({path}:{line})"),
])
@pytest.mark.parametrize("workers", ["1", "3"])
def test_bad_appended_lines_fail_as_a_whole_read_does_and_leave_the_plan_before(tmp_path, monkeypatch, tail, message,
                                                                                 workers):
    """20 good lines and a bad one appended; planned in one process, or in three that give the new lines back to
    the driver on meeting the bad one (the kept columns then read on from the cache as they were)."""
    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", workers)
    path = tmp_path / "m.jsonl"
    path.write_text(lines_of(60))
    spec = {"path": str(path), "format": "jsonl"}
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"shard_size": 16})
    before = written_files(set_dir)
    with open(path, "a") as f:
        f.write(lines_of(20, 60) + tail)
    line = len(path.read_text().splitlines())
    with pytest.raises(DataError) as new:
        ensure_plan(set_dir, spec, {"shard_size": 16})
    with pytest.raises(DataError) as old:
        reference_files(spec, {"shard_size": 16})
    assert str(new.value) == str(old.value)
    assert str(new.value).startswith(message.format(path=path, line=line))
    assert written_files(set_dir) == before


@pytest.mark.parametrize("workers", ["1", "3"])
@pytest.mark.parametrize("block_bytes", [manifest.BLOCK_BYTES, 300])
def test_records_without_audio_among_records_with_it_are_refused_at_the_plan(tmp_path, monkeypatch, workers,
                                                                              block_bytes):
    """A record that names no audio (its field missing, or null) in a manifest whose other records name theirs:
    every stage that loads audio would fail on it a shard at a time (found by a user trial, 2026-11-27), so the
    plan refuses it, naming the keys, lines and the config key that says the field. Nothing is written; an append
    of such a record leaves the plan before as it was. A manifest with no audio at all (text only) plans."""
    monkeypatch.setattr(manifest, "BLOCK_BYTES", block_bytes)
    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", workers)
    path = tmp_path / "m.jsonl"
    records = [{"key": f"k{i:02d}", "audio": WAVS[i % 10], "duration": 1.5} for i in range(80)]
    records[61] = {"key": "k61", "duration": 1.5, "text": "no audio field"}
    records[70]["audio"] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = {"path": str(path), "format": "jsonl", "name": "base"}
    with pytest.raises(DataError) as refused:
        ensure_plan(tmp_path / "set", spec, {"shard_size": 16})
    assert str(refused.value) == (
        f"datasets.base: 2 of 80 records name no audio (datasets.base.audio_field is 'audio'), which the other 78 do: "
        f"'k61' ({path}:62), 'k70' ({path}:71). Give every record its audio, or none (a text-only dataset)")
    assert not (tmp_path / "set").exists()

    path.write_text("".join(json.dumps(r) + "\n" for r in records[:60]))
    ensure_plan(tmp_path / "set", spec, {"shard_size": 16})
    before = written_files(tmp_path / "set")
    with open(path, "a") as f:
        f.write(json.dumps({"key": "late", "duration": 2.0}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"1 of 61 records names no audio (datasets.base.audio_field is "
                                                  f"'audio'), which the other 60 do: 'late' ({path}:61).")):
        ensure_plan(tmp_path / "set", spec, {"shard_size": 16})
    assert written_files(tmp_path / "set") == before

    text_only = tmp_path / "text.jsonl"
    text_only.write_text("".join(json.dumps({"key": f"t{i}", "text": "hello"}) + "\n" for i in range(30)))
    assert ensure_plan(tmp_path / "text", {"path": str(text_only), "format": "jsonl"}, {"num_shards": 2})["num_items"] == 30


def test_shards_are_kept_only_from_the_plan_the_cached_columns_were_read_for(tmp_path, monkeypatch):
    """A planner killed between keeping its columns and writing plan.json leaves the plan before (of an older
    manifest) beside newer columns: an append after that keeps none of that plan's shards (line 5 was edited
    in between: its shard's records digest must be the new one)."""
    from snakeshard.core import plan as planner

    path = tmp_path / "m.jsonl"
    path.write_text(lines_of(100))
    spec = {"path": str(path), "format": "jsonl"}
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"shard_size": 16})
    path.write_text(lines_of(100).replace('"u0004", "duration": 4.5, "text": "abababab"',
                                          '"u0004", "duration": 4.5, "text": "edited!!"'))
    write_json = planner.atomic_write_json

    def killed_at_plan_json(target, obj, **kw):
        if str(target).endswith("plan.json"):
            raise KeyboardInterrupt("killed")
        write_json(target, obj, **kw)

    monkeypatch.setattr(planner, "atomic_write_json", killed_at_plan_json)
    with pytest.raises(KeyboardInterrupt):
        ensure_plan(set_dir, spec, {"shard_size": 16})
    monkeypatch.setattr(planner, "atomic_write_json", write_json)
    with open(path, "a") as f:
        f.write(lines_of(3, 100))
    ensure_plan(set_dir, spec, {"shard_size": 16})
    assert written_files(set_dir) == reference_files(spec, {"shard_size": 16})


def test_an_audio_file_gone_since_the_plan_before_is_named_with_its_key_and_line(tmp_path):
    """The kept columns hold the audio paths; one deleted since is refused as a full read refuses it."""
    wav = tmp_path / "a.wav"
    wav.write_bytes(Path(WAVS[0]).read_bytes())
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"key": f"k{i}", "audio": str(wav if i == 3 else WAVS[i]), "duration": 1.0})
                            + "\n" for i in range(6)))
    spec = {"path": str(path), "format": "jsonl"}
    ensure_plan(tmp_path / "set", spec, {"num_shards": 2})
    wav.unlink()
    with open(path, "a") as f:
        f.write(json.dumps({"key": "k6", "duration": 1.0}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"1 audio file(s) not found: key 'k3': {wav} ({path}:4)")):
        ensure_plan(tmp_path / "set", spec, {"num_shards": 2})


def test_kept_shards_with_an_unreadable_audio_list_are_planned_anew(tmp_path):
    """The shards kept on an append take their audio lists from audio_files.json; edited into something that does
    not read, every shard is planned anew rather than left without one."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"key": f"k{i:02d}", "audio": WAVS[i % 10], "duration": 1.0}) + "\n"
                            for i in range(40)))
    spec = {"path": str(path), "format": "jsonl"}
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"shard_size": 8})
    (set_dir / "audio_files.json").write_text('[["only one shard"]]\n')
    with open(path, "a") as f:
        f.write(json.dumps({"key": "k40", "audio": WAVS[0], "duration": 1.0}) + "\n")
    ensure_plan(set_dir, spec, {"shard_size": 8})
    assert written_files(set_dir) == reference_files(spec, {"shard_size": 8})


@pytest.mark.parametrize("sharding_after", [{"shard_size": 4}, {"num_shards": 3}])
def test_the_kept_columns_hold_the_manifests_durations_not_those_read_from_headers(tmp_path, sharding_after):
    """A manifest without durations, planned by seconds (durations then read from the audio headers), then by
    count after lines were appended: the columns read back still say 'no duration', so the plan holds no seconds,
    as a whole read's does."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"key": f"k{i:02d}", "audio": WAVS[i % 10]}) + "\n" for i in range(20)))
    spec = {"path": str(path), "format": "jsonl"}
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"shard_seconds": 6})
    with open(path, "a") as f:
        f.write(json.dumps({"key": "k20", "audio": WAVS[0]}) + "\n")
    ensure_plan(set_dir, spec, sharding_after)
    expected = reference_files(spec, sharding_after)
    written = written_files(set_dir)  # and split dirs of the first plan's extra shards, left as always
    assert {name: written[name] for name in expected} == expected


@pytest.mark.parametrize("workers", ["1", "3"])
@pytest.mark.parametrize("block_bytes", [manifest.BLOCK_BYTES, 300])
def test_an_append_after_a_partial_last_shard_replans_from_inside_a_block(tmp_path, monkeypatch, block_bytes, workers):
    """200 lines in shards of 3: the last shard held 2 items, so after 57 appended lines planning starts again at
    item 198, inside a block of the kept columns. (The keys of the shards after it were those of 3 items before,
    out of step with their lines, until 2026-11-26.)"""
    monkeypatch.setattr(manifest, "BLOCK_BYTES", block_bytes)
    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", workers)
    path = tmp_path / "m.jsonl"
    path.write_text(lines_of(200))
    spec = {"path": str(path), "format": "jsonl"}
    ensure_plan(tmp_path / "set", spec, {"shard_size": 3})
    with open(path, "a") as f:
        f.write(lines_of(57, 200))
    ensure_plan(tmp_path / "set", spec, {"shard_size": 3})
    assert written_files(tmp_path / "set") == reference_files(spec, {"shard_size": 3})


# -- a big manifest planned in forked processes (core/forked.py) -----------------------------------

def forked_pids(monkeypatch, tmp_path: Path) -> Path:
    """A file that each process running a pass-1 range or pass-2 shards appends its pid to."""
    from snakeshard.core import plan as planner

    log = tmp_path / "pids"
    scan_range, shards = manifest.JsonlManifest._scan_range, manifest.JsonlManifest.shards

    def logged(method):
        def run(self, *args):
            with open(log, "a") as f:
                f.write(f"{method.__name__} {os.getpid()}\n")
            return method(self, *args)
        return run

    monkeypatch.setattr(manifest.JsonlManifest, "_scan_range", logged(scan_range))
    monkeypatch.setattr(manifest.JsonlManifest, "shards", logged(shards))
    assert planner.scan_manifest is manifest.scan_manifest
    return log


@pytest.mark.parametrize("workers", ["2", "3"])
@pytest.mark.parametrize("block_bytes", [manifest.BLOCK_BYTES, 300])
def test_forked_planning_writes_what_one_process_writes(tmp_path, monkeypatch, block_bytes, workers):
    """SNAKESHARD_PLAN_WORKERS forks both passes at any size: the same files as the planner before streaming, for
    every sharding; the work was done in other processes (a plan of one shard: its pass 2 here)."""
    monkeypatch.setattr(manifest, "BLOCK_BYTES", block_bytes)
    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", workers)
    log = forked_pids(monkeypatch, tmp_path)
    spec = varied_manifest(tmp_path / "varied.jsonl", 600)
    for sharding in SHARDINGS:
        same_as_reference(tmp_path, spec, sharding)
    ran = [line.split() for line in log.read_text().splitlines()]
    for method in ("_scan_range", "shards"):
        forked = {pid for name, pid in ran if name == method} - {str(os.getpid())}
        assert len(forked) >= 2, (method, ran)
    assert str(os.getpid()) not in {pid for name, pid in ran if name == "_scan_range"}


def test_duplicate_keys_in_two_forked_ranges_are_named_as_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", "3")
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"key": f"k{i % 290:03d}", "duration": 1.0}) + "\n" for i in range(300)))
    message = same_error_as_reference(tmp_path / "set", {"path": str(path), "format": "jsonl"}, {"num_shards": 4})
    assert message.startswith(f"10 duplicate key(s): 'k000' ({path}:291, first at {path}:1)")


def test_a_forked_planner_that_dies_fails_the_plan_naming_the_way_out(tmp_path, monkeypatch):
    """A worker killed (as the OOM killer kills) fails the plan in seconds rather than hanging, and leaves no
    plan.json; the next plan (here in one process) writes the whole plan."""
    import signal

    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", "2")
    monkeypatch.setattr(manifest.JsonlManifest, "_scan_range", lambda self, part: os.kill(os.getpid(), signal.SIGKILL))
    path = tmp_path / "m.jsonl"
    path.write_text(lines_of(100))
    spec = {"path": str(path), "format": "jsonl"}
    with pytest.raises(SnakeshardError) as failed:
        ensure_plan(tmp_path / "set", spec, {"shard_size": 16})
    assert str(failed.value) == ("a planning process forked from this one died (killed, or out of memory?); the plan "
                                 "was not written: run again, or plan in one process with SNAKESHARD_PLAN_WORKERS=1")
    assert not (tmp_path / "set/plan.json").exists()
    monkeypatch.undo()
    ensure_plan(tmp_path / "set", spec, {"shard_size": 16})
    assert written_files(tmp_path / "set") == reference_files(spec, {"shard_size": 16})


@pytest.mark.parametrize("ending", ["\n", ""])
def test_a_forked_plan_describes_the_manifest_for_an_append_as_one_process_does(tmp_path, monkeypatch, ending):
    """What the cache keeps to tell an appended manifest from an edited one (size, SHA-256 of the bytes, lines, the
    last newline, items) is the same whether pass 1 ran forked or here: were it not, every append would read the
    whole manifest again, unseen."""
    path = tmp_path / "m.jsonl"
    path.write_text(lines_of(300).rstrip("\n") + ending)
    spec = {"path": str(path), "format": "jsonl"}
    described = {}
    for workers in ("1", "3"):
        monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", workers)
        ensure_plan(tmp_path / workers, spec, {"shard_size": 16})
        meta = json.loads((tmp_path / workers / manifest.CACHE_DIR / manifest.CACHE_META).read_text())
        described[workers] = {k: meta[k] for k in ("size", "sha256", "lines", "ends_with_newline", "num_items")}
    assert described["3"] == described["1"]
    assert described["1"]["ends_with_newline"] == (ending == "\n") and described["1"]["num_items"] == 300


def test_manifests_from_4_mb_are_planned_by_a_process_a_core_at_most_4():
    from snakeshard.core.forked import MAX_WORKERS, PARALLEL_BYTES, plan_workers

    assert plan_workers(PARALLEL_BYTES - 1) == 1
    assert plan_workers(PARALLEL_BYTES) == min(MAX_WORKERS, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_plan_workers_setting_is_refused_naming_it(tmp_path, monkeypatch, value):
    monkeypatch.setenv("SNAKESHARD_PLAN_WORKERS", value)
    path = tmp_path / "m.jsonl"
    path.write_text(lines_of(10))
    with pytest.raises(ConfigError, match=re.escape(f"SNAKESHARD_PLAN_WORKERS={value!r}: give a number of "
                                                    "processes, 1 or more")):
        ensure_plan(tmp_path / "set", {"path": str(path), "format": "jsonl"}, {"num_shards": 2})


def test_snakemake_plans_a_manifest_in_forked_processes_as_in_one(tmp_path, monkeypatch):
    """The real driver: `snakemake -n` with 2 planning processes, then the same project planned in one process
    (the plan removed): the same plan files, byte for byte."""
    import subprocess
    import sys

    import yaml
    from conftest import copy_workflow

    wd = copy_workflow(tmp_path / "wf")
    (wd / "m.jsonl").write_text("".join(json.dumps({"key": f"u{i:05d}", "audio": WAVS[i % 10], "duration": 1 + i % 7})
                                        + "\n" for i in range(3000)))
    config = {"canary": 0, "datasets": {"big": {"path": "m.jsonl", "format": "jsonl"}},
              "stages": {"fbank": {"runner": "snakeshard.stages.fbank.FbankRunner",
                                   "provider": "snakeshard.stages.fbank.FbankProvider",
                                   "datasets": ["big"], "sharding": {"shard_size": 100}}}}
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config))
    set_dir = wd / "results/fbank/big"
    planned = {}
    for workers in ("2", "1"):
        dry = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "-q"], cwd=wd, text=True,
                             capture_output=True, env={**os.environ, "SNAKESHARD_PLAN_WORKERS": workers}, timeout=300)
        assert dry.returncode == 0, dry.stderr[-3000:]
        planned[workers] = written_files(set_dir)
        shutil.rmtree(set_dir)
    assert planned["2"] == planned["1"] and "split.29/items.json" in planned["1"]
