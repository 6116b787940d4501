"""Unit tests of snakeshard.core.plan: contiguous cost-balanced splitting, budgets, determinism, plan.json caching."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest

from snakeshard.core.data import Item
from snakeshard.core.fingerprint import keys_digest
from snakeshard.core.manifest import ItemsManifest
from snakeshard.core.plan import ensure_plan, make_plan, shard_counts, split_by_budget, split_contiguous
from snakeshard.core.shard_files import read_shard_keys
from snakeshard.errors import ConfigError, DataError

PROJECT = Path(__file__).resolve().parents[1]
DEMO_WAV = PROJECT / "data/demo/wav/cards-001.wav"
# data/demo/utt2dur, in wav.scp order
DEMO_DURATIONS = [1.095, 1.96, 1.538, 1.554, 3.502, 7.1, 2.99, 5.3, 6.05, 3.29]


def shard_costs(costs: list[float], starts: list[int]) -> list[float]:
    ends = starts[1:] + [len(costs)]
    return [sum(costs[a:b]) for a, b in zip(starts, ends)]


def shard_sizes(starts: list[int], n: int) -> list[int]:
    return [b - a for a, b in zip(starts, starts[1:] + [n])]


def kaldi_dir(path: Path, keys: list[str], durations: list[float] | None = None) -> dict:
    """A Kaldi data dir (every key -> the same existing wav), optionally with utt2dur; returns its spec."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "wav.scp").write_text("".join(f"{k} {DEMO_WAV}\n" for k in keys))
    if durations is not None:
        (path / "utt2dur").write_text("".join(f"{k} {d}\n" for k, d in zip(keys, durations)))
    return {"path": str(path), "format": "kaldi"}


def items(costs: list[float | None]) -> list[Item]:
    return [Item(f"k{i:03d}", f"test:{i + 1}", seconds=c) for i, c in enumerate(costs)]


def plan_shards(its: list[Item], sharding: dict) -> list[list[Item]]:
    """The planner's cut of hand-made items, as lists of them."""
    shards, start = [], 0
    for count in shard_counts(ItemsManifest(its), sharding):
        shards.append(its[start:start + count])
        start += count
    return shards


def planned(spec: dict, sharding: dict) -> tuple[dict, list[list[str]]]:
    """make_plan's plan and each shard's keys."""
    keys = []
    plan = make_plan(spec, sharding, on_shard=lambda n, rows: keys.append(rows.keys))
    return plan, keys


# -- split_contiguous ---------------------------------------------------------------------------

def test_split_contiguous_balances_durations():
    """Feeds the demo durations into 2 shards: the cut must balance seconds (16.7 / 17.6 s), not item counts (5 / 5)."""
    starts = split_contiguous(DEMO_DURATIONS, 2)
    assert starts == [0, 6]
    a, b = shard_costs(DEMO_DURATIONS, starts)
    assert abs(a - b) < 1.0


def test_split_contiguous_uniform_costs_sizes_differ_by_at_most_one():
    """Feeds n equal costs into k shards (all n, k up to 40): min(n, k) shards, sizes within 1 of each other."""
    for n in range(1, 41):
        for k in range(1, n + 3):
            starts = split_contiguous([1.0] * n, k)
            sizes = shard_sizes(starts, n)
            assert len(starts) == min(n, k), (n, k, starts)
            assert min(sizes) >= 1, (n, k, sizes)
            assert max(sizes) - min(sizes) <= 1, (n, k, sizes)


def test_split_contiguous_random_costs_never_empty_and_near_balanced():
    """Feeds 2000 seeded random cost lists: no empty shard, starts strictly increasing, no shard over mean + largest item."""
    rng = random.Random(1234)
    for _ in range(2000):
        n = rng.randint(1, 50)
        k = rng.randint(1, 60)
        costs = [rng.choice([rng.uniform(0.1, 2), rng.uniform(0.1, 40)]) for _ in range(n)]
        starts = split_contiguous(costs, k)
        assert starts[0] == 0
        assert len(starts) == min(n, k)
        assert all(b > a for a, b in zip(starts, starts[1:] + [n])), (costs, k, starts)
        per_shard = shard_costs(costs, starts)
        assert max(per_shard) <= sum(costs) / len(starts) + max(costs) + 1e-9, (costs, k, starts)


def test_split_contiguous_heavy_items_still_one_item_per_shard():
    """Feeds one huge item then small ones into 3 shards: 3 non-empty shards, the huge item alone in the first."""
    costs = [100.0, 1.0, 1.0, 1.0]
    assert split_contiguous(costs, 3) == [0, 1, 2]
    costs = [1.0, 1.0, 1.0, 1.0, 100.0]
    starts = split_contiguous(costs, 3)
    assert len(starts) == 3 and starts[-1] == 4  # the 100 s item stands alone at the end


def test_num_shards_greater_than_items_caps_at_items():
    """Asks for 10 shards of 3 items: gets 3 shards of one item each, none empty."""
    shards = plan_shards(items([1.0, 2.0, 3.0]), {"num_shards": 10})
    assert [[i.key for i in s] for s in shards] == [["k000"], ["k001"], ["k002"]]


def test_one_missing_duration_is_read_from_its_audio_header_not_a_switch_to_counts(tmp_path):
    """utt2dur lacks one key: its duration comes from its wav header (per-key fallback); the plan stays
    balanced by seconds. Before, the whole plan silently switched to item counts."""
    import numpy as np
    import soundfile as sf

    wav = tmp_path / "k001.wav"
    sf.write(wav, np.zeros(16000 * 100, dtype="int16"), 16000)  # 100 s
    costs = [1.0, None, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    its = items(costs)
    its[1].audio = str(wav)
    shards = plan_shards(its, {"num_shards": 2})
    assert [len(s) for s in shards] == [2, 8]  # by counts it would be [5, 5]
    assert its[1].seconds == 100.0


def test_one_missing_duration_behind_a_pipe_is_an_error_naming_the_key():
    """A key without a duration whose audio is a pipe: no header to read, so the plan fails naming it."""
    its = items([1.0, None, 1.0])
    its[1].audio = "sox x.wav -t wav - |"
    with pytest.raises(DataError, match=r"key 'k001' \(test:2\): cannot read a duration from 'sox x.wav -t wav - \|'"):
        plan_shards(its, {"num_shards": 2})


# -- shard_size / shard_seconds ----------------------------------------------------------------

def test_shard_size_makes_fixed_size_shards_with_a_short_last_one():
    """Plans 23 items with shard_size 5: shards of 5,5,5,5,3 in file order."""
    shards = plan_shards(items([1.0] * 23), {"shard_size": 5})
    assert [len(s) for s in shards] == [5, 5, 5, 5, 3]
    assert [i.key for s in shards for i in s] == [f"k{i:03d}" for i in range(23)]


def test_shard_seconds_budget_and_long_item_stands_alone():
    """Plans durations under a 10 s budget: each shard stays within it, and a 25 s item is a shard by itself."""
    costs = [4.0, 4.0, 3.0, 25.0, 2.0, 2.0, 6.0, 9.0]
    shards = plan_shards(items(costs), {"shard_seconds": 10})
    seconds = [[i.seconds for i in s] for s in shards]
    assert seconds == [[4.0, 4.0], [3.0], [25.0], [2.0, 2.0, 6.0], [9.0]]
    assert split_by_budget(costs, 10) == [0, 2, 3, 4, 7]


def test_shard_seconds_reads_durations_from_audio_headers(tmp_path):
    """Plans a Kaldi dir without utt2dur by shard_seconds: durations come from the wav headers (1.095 s each)."""
    spec = kaldi_dir(tmp_path / "data", [f"u{i}" for i in range(5)])
    plan, keys = planned(spec, {"shard_seconds": 2.5})
    assert keys == [["u0", "u1"], ["u2", "u3"], ["u4"]]
    assert [s["seconds"] for s in plan["shards"]] == [2.191, 2.191, 1.095]


def test_max_shard_items_adds_shards_to_a_dataset_that_outgrows_them():
    """num_shards 8 with max_shard_items 10 (the default's rule, at 100,000): 8 shards up to 80 items, then at
    least ceil(items / 10); explicit num_shards alone stays at 8 however big the dataset."""
    capped = {"num_shards": 8, "max_shard_items": 10}
    assert len(plan_shards(items([1.0] * 80), capped)) == 8
    assert len(plan_shards(items([1.0] * 81), capped)) == 9
    shards = plan_shards(items([1.0] * 250), capped)
    assert len(shards) == 25 and {len(s) for s in shards} == {10}
    assert len(plan_shards(items([1.0] * 250), {"num_shards": 8})) == 8


def test_max_shard_items_goes_with_num_shards_alone():
    """With shard_size or shard_seconds it means nothing: the config check says so, naming the key."""
    from snakeshard.workflow.parse import validate_config

    config = {"datasets": {"demo": {"path": "data/demo"}},
              "stages": {"s": {"runner": "m.R", "provider": "m.P", "datasets": ["demo"],
                               "sharding": {"shard_size": 5, "max_shard_items": 10}}}}
    with pytest.raises(ConfigError, match=re.escape("stages.s.sharding.max_shard_items: only with num_shards "
                                                    "(shard_size already sets how big a shard is)")):
        validate_config(config)


def test_sharding_needs_exactly_one_mode():
    """Gives both num_shards and shard_size (and then neither): ConfigError naming the modes."""
    with pytest.raises(ConfigError, match=r"sharding: set exactly one of num_shards, shard_size, shard_seconds \(got "
                                          r"\['num_shards', 'shard_size'\]\)"):
        plan_shards(items([1.0]), {"num_shards": 2, "shard_size": 1})
    with pytest.raises(ConfigError, match="got none"):
        plan_shards(items([1.0]), {})


# -- make_plan / determinism ---------------------------------------------------------------------

def test_make_plan_is_deterministic(tmp_path):
    """Plans the same dataset twice (and a copy of it elsewhere): identical keys and per-shard records."""
    keys = [f"utt{i:03d}" for i in range(37)]
    durs = [1.0 + (i * 7 % 11) for i in range(37)]
    a = kaldi_dir(tmp_path / "a", keys, durs)
    b = kaldi_dir(tmp_path / "b", keys, durs)
    plan1, keys1 = planned(a, {"num_shards": 6})
    plan2, keys2 = planned(a, {"num_shards": 6})
    plan3, keys3 = planned(b, {"num_shards": 6})
    assert keys1 == keys2 == keys3
    assert plan1["shards"] == plan2["shards"] == plan3["shards"]
    assert plan1 == plan2


def test_make_plan_rejects_missing_audio_naming_key_path_and_line(tmp_path):
    """Plans a wav.scp whose third line points at a missing file: DataError with key, path and wav.scp:3."""
    d = kaldi_dir(tmp_path / "d", ["a", "b"])
    with open(tmp_path / "d/wav.scp", "a") as f:
        f.write(f"c {tmp_path}/nope.wav\n")
    with pytest.raises(DataError) as e:
        make_plan(d, {"num_shards": 2})
    msg = str(e.value)
    assert "'c'" in msg and f"{tmp_path}/nope.wav" in msg and "wav.scp:3" in msg


def test_jsonl_dataset_with_key_field_and_durations(tmp_path):
    """Plans a JSON Lines file keyed by 'id' with 'dur' seconds: keys come from 'id', shards balance 'dur'."""
    records = [{"id": f"rec-{i}", "dur": d, "text": "x"} for i, d in enumerate([8, 1, 1, 1, 1, 1, 1, 1, 1])]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")  # a trailing blank line is allowed
    spec = {"path": str(path), "format": "jsonl", "key_field": "id", "duration_field": "dur"}
    plan, keys = planned(spec, {"num_shards": 2})
    assert keys == [["rec-0"], [f"rec-{i}" for i in range(1, 9)]]
    assert plan["num_items"] == 9 and plan["total_seconds"] == 16
    assert [(s["items"], s["seconds"]) for s in plan["shards"]] == [(1, 8), (8, 8)]


def test_jsonl_record_without_key_field_names_line(tmp_path):
    """Plans a JSON Lines file whose 2nd record lacks key_field 'id': DataError naming file:2 and 'id'."""
    path = tmp_path / "set.jsonl"
    path.write_text('{"id": "a"}\n{"key": "b"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: record has no key field 'id'"):
        make_plan({"path": str(path), "format": "jsonl", "key_field": "id"}, {"num_shards": 1})


@pytest.mark.parametrize("bad_line, message", [
    ('{"key": "c", "text": ', "not valid JSON (Expecting value)"),
    ('{"key": "c"} {"key": "d"}', "not valid JSON (Extra data)"),  # two records on one line
    ('{"key": "c"}, {"key": "d"}', "not valid JSON (Extra data)"),  # joined as an array, this would parse
])
def test_jsonl_line_that_is_not_one_record_names_its_line(tmp_path, bad_line, message):
    """The manifest is parsed in one call; a line that is not exactly one JSON value still fails naming it
    (file:line, after a blank line, which is skipped but counted)."""
    path = tmp_path / "set.jsonl"
    path.write_text('{"key": "a"}\n\n{"key": "b"}\n' + bad_line + '\n{"key": "e"}\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:4: {message}")):
        make_plan({"path": str(path), "format": "jsonl"}, {"num_shards": 1})


# -- ensure_plan caching -------------------------------------------------------------------------

def mtimes(set_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(set_dir)): p.stat().st_mtime_ns for p in sorted(set_dir.rglob("*")) if p.is_file()}


def age_files(set_dir: Path, ns: int = 1_000_000_000_000_000_000) -> None:
    """Set every file's mtime to a fixed past instant, so a rewrite is detectable at any clock resolution."""
    for p in set_dir.rglob("*"):
        if p.is_file():
            os.utime(p, ns=(ns, ns))


def test_ensure_plan_writes_plan_json_and_keys(tmp_path):
    """Plans 10 keys with durations into 3 shards: plan.json is JSON with items/seconds per shard, split.N/keys hold the keys."""
    keys = [f"u{i}" for i in range(10)]
    spec = kaldi_dir(tmp_path / "data", keys, DEMO_DURATIONS)
    set_dir = tmp_path / "results/s/d"
    plan = ensure_plan(set_dir, spec, {"num_shards": 3})
    on_disk = json.loads((set_dir / "plan.json").read_text())
    assert on_disk == plan
    assert on_disk["num_shards"] == 3 and on_disk["num_items"] == 10
    assert on_disk["total_seconds"] == round(sum(DEMO_DURATIONS), 3)
    got_keys = []
    for rec in on_disk["shards"]:
        shard_keys = read_shard_keys(set_dir / f"split.{rec['shard']}")
        assert (set_dir / f"split.{rec['shard']}/keys").read_bytes() == "".join(k + "\n" for k in shard_keys).encode()
        assert rec["items"] == len(shard_keys)
        assert rec["seconds"] == round(sum(DEMO_DURATIONS[keys.index(k)] for k in shard_keys), 3)
        assert rec["keys_digest"] == keys_digest(shard_keys)
        assert (rec["first_key"], rec["last_key"]) == (shard_keys[0], shard_keys[-1])
        got_keys += shard_keys
    assert got_keys == keys


def test_ensure_plan_second_call_rewrites_nothing(tmp_path):
    """Calls ensure_plan twice on unchanged data: same plan, and plan.json and every split.N/keys keep their mtime."""
    spec = kaldi_dir(tmp_path / "data", [f"u{i:02d}" for i in range(40)])
    set_dir = tmp_path / "set"
    first = ensure_plan(set_dir, spec, {"num_shards": 4})
    age_files(set_dir)
    before = mtimes(set_dir)
    assert len(before) == 10  # plan.json, audio_files.json + 4 keys and 4 items.json files
    second = ensure_plan(set_dir, spec, {"num_shards": 4})
    assert second == first
    assert mtimes(set_dir) == before


def test_ensure_plan_after_data_change_rewrites_only_changed_shards(tmp_path):
    """Renames one key in shard 2 (shard_size 10) and appends 3 keys: only split.2 and a new split.4 are written."""
    keys = [f"u{i:02d}" for i in range(40)]
    spec = kaldi_dir(tmp_path / "data", keys)
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"shard_size": 10})
    age_files(set_dir)
    before = mtimes(set_dir)

    keys[25] = "u25-renamed"
    kaldi_dir(tmp_path / "data", keys + ["v1", "v2", "v3"])
    plan = ensure_plan(set_dir, spec, {"shard_size": 10})

    after = mtimes(set_dir)
    assert plan["num_shards"] == 5
    for n in (0, 1, 3):
        assert after[f"split.{n}/keys"] == before[f"split.{n}/keys"], n
    assert after["split.2/keys"] != before["split.2/keys"]
    assert "u25-renamed\n" in (set_dir / "split.2/keys").read_text()
    assert read_shard_keys(set_dir / "split.4") == ["v1", "v2", "v3"]
    assert after["plan.json"] != before["plan.json"]
    assert json.loads((set_dir / "plan.json").read_text())["num_items"] == 43


def test_ensure_plan_replans_when_sharding_config_changes(tmp_path):
    """Changes num_shards 4 -> 2 on unchanged data: the cached plan is not reused, plan.json says 2 shards."""
    spec = kaldi_dir(tmp_path / "data", [f"u{i:02d}" for i in range(8)])
    set_dir = tmp_path / "set"
    assert ensure_plan(set_dir, spec, {"num_shards": 4})["num_shards"] == 4
    assert ensure_plan(set_dir, spec, {"num_shards": 2})["num_shards"] == 2
    assert json.loads((set_dir / "plan.json").read_text())["num_shards"] == 2
    assert read_shard_keys(set_dir / "split.0") == ["u00", "u01", "u02", "u03"]


def test_ensure_plan_replans_when_a_keys_file_is_missing(tmp_path):
    """Deletes split.1/keys after planning: the next ensure_plan writes it again with the same keys."""
    spec = kaldi_dir(tmp_path / "data", [f"u{i}" for i in range(6)])
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"num_shards": 3})
    expected = (set_dir / "split.1/keys").read_bytes()
    (set_dir / "split.1/keys").unlink()
    ensure_plan(set_dir, spec, {"num_shards": 3})
    assert (set_dir / "split.1/keys").read_bytes() == expected


def test_ensure_plan_on_bad_data_keeps_previous_plan(tmp_path):
    """Plans, then adds a duplicate key: DataError names both lines, and plan.json / keys stay byte-identical."""
    spec = kaldi_dir(tmp_path / "data", ["a", "b", "c", "d"])
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"num_shards": 2})
    age_files(set_dir)
    before = {p: (set_dir / p).read_bytes() for p in mtimes(set_dir)}
    before_mtimes = mtimes(set_dir)
    with open(tmp_path / "data/wav.scp", "a") as f:
        f.write(f"b {DEMO_WAV}\n")
    with pytest.raises(DataError, match=r"'b' \(.*wav.scp:5, first at .*wav.scp:2\)"):
        ensure_plan(set_dir, spec, {"num_shards": 2})
    assert {p: (set_dir / p).read_bytes() for p in mtimes(set_dir)} == before
    assert mtimes(set_dir) == before_mtimes


def test_jsonl_record_change_changes_only_its_shards_records_digest(tmp_path):
    """A JSON Lines record edited under the same key: the plan's keys digests stay, the records digest of
    that key's shard (and only it) changes, so only that shard's fingerprint changes."""
    path = tmp_path / "x.jsonl"
    rows = [{"key": f"k{i}", "audio": str(tmp_path / "a.wav"), "duration": 1.0, "lang": "en"} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.wav").write_bytes(b"")
    spec = {"path": str(path), "format": "jsonl"}
    before, _ = planned(spec, {"shard_size": 2})
    rows[3]["lang"] = "de"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    after, _ = planned(spec, {"shard_size": 2})
    assert [s["keys_digest"] for s in before["shards"]] == [s["keys_digest"] for s in after["shards"]]
    changed = [n for n, (a, b) in enumerate(zip(before["shards"], after["shards"])) if a["records"] != b["records"]]
    assert changed == [1]


def test_each_shard_gets_its_slice_of_the_dataset(tmp_path):
    """split.N/items.json holds exactly the shard's items, with where each was declared; a dataset built
    from it (as a shard job's load_dataset is) has those keys only, and names the slice for any other key."""
    from snakeshard import load_dataset
    from snakeshard.core.shard_files import SHARD_ITEMS

    spec = kaldi_dir(tmp_path / "data", [f"u{i:02d}" for i in range(40)])
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"num_shards": 4})
    full = load_dataset(spec)
    for n in range(4):
        keys = read_shard_keys(set_dir / f"split.{n}")
        part = load_dataset({**spec, "shard_items": str(set_dir / f"split.{n}" / SHARD_ITEMS)})
        assert part.keys == keys and len(part) == 10
        for key in keys:
            assert part[key] == full[key] and part._items[key].source == full._items[key].source
    with pytest.raises(KeyError, match=r"'u00': not in this shard job's slice of the dataset .*split\.3/items\.json"):
        part["u00"]


def test_a_jsonl_slice_holds_each_record_as_written(tmp_path):
    """A JSON Lines shard's slice splices each record's line in as written (no re-encoding): the fields a job
    sees equal the full dataset's, whatever the line's spacing, escapes or non-ASCII text."""
    from snakeshard import load_dataset
    from snakeshard.core.shard_files import SHARD_ITEMS

    lines = ['{"key": "a", "text": "caf\\u00e9", "n": [1, {"x": null}]}',
             '{ "key" : "b" , "text" : "naïve", "duration": 2 }',
             '{"key":"c","text":"tab\\there","ok":true}',
             '{"key": "d", "text": "\\"quoted\\""}']
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = {"path": str(path), "format": "jsonl"}
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"shard_size": 2})
    full = load_dataset(spec)
    for n, keys in enumerate([["a", "b"], ["c", "d"]]):
        part = load_dataset({**spec, "shard_items": str(set_dir / f"split.{n}" / SHARD_ITEMS)})
        assert part.keys == keys
        for key in keys:
            assert part[key] == full[key] and part._items[key].source == full._items[key].source
            assert part._items[key].seconds == full._items[key].seconds
    assert full["a"]["text"] == "café" and full["b"]["text"] == "naïve" and full["d"]["text"] == '"quoted"'


def test_a_replan_rewrites_the_slices(tmp_path):
    """An edited text line changes the plan's signature: the slice holds the new text."""
    from snakeshard import load_dataset
    from snakeshard.core.shard_files import SHARD_ITEMS

    spec = kaldi_dir(tmp_path / "data", [f"u{i}" for i in range(6)])
    set_dir = tmp_path / "set"
    ensure_plan(set_dir, spec, {"num_shards": 2})
    text = Path(spec["path"]) / "text"
    text.write_text("".join(f"u{i} {'changed' if i == 4 else 'words'}\n" for i in range(6)))
    ensure_plan(set_dir, spec, {"num_shards": 2})
    part = load_dataset({**spec, "shard_items": str(set_dir / "split.1" / SHARD_ITEMS)})
    assert part["u4"]["text"] == "changed"


def test_overlapping_shards_are_the_upstream_shards_holding_each_shards_keys():
    """A chained set's shards and its upstream's cut the same keys: the overlap of their key ranges, checked
    against the keys themselves for many random cuts."""
    from snakeshard.core.plan import overlapping_shards

    def plan_of(sizes):
        return {"num_items": sum(sizes), "num_shards": len(sizes), "shards": [{"items": n} for n in sizes]}

    def cut(n, rng):
        bounds = sorted(rng.sample(range(1, n), rng.randrange(0, min(n - 1, 6) + 1)))
        return [b - a for a, b in zip([0, *bounds], [*bounds, n])]

    rng = random.Random(0)
    for _ in range(500):
        n = rng.randrange(1, 40)
        up, down = cut(n, rng), cut(n, rng)
        starts_up = [sum(up[:j]) for j in range(len(up))]
        owner = [max(j for j, s in enumerate(starts_up) if s <= k) for k in range(n)]
        expected, start = [], 0
        for size in down:
            expected.append(sorted({owner[k] for k in range(start, start + size)}))
            start += size
        assert overlapping_shards(plan_of(up), plan_of(down)) == expected, (up, down)
    # not the same keys (should not happen): every shard depends on all of upstream
    assert overlapping_shards(plan_of([2, 2]), plan_of([3])) == [[0, 1]]


@pytest.mark.parametrize("table", ["wav.scp", "utt2dur", "text", "utt2spk"])
def test_a_key_repeated_in_any_kaldi_table_is_refused_naming_both_lines(tmp_path, table):
    """Kaldi's validate_data_dir.sh refuses a repeated key in any table; snakeshard took the last line of wav.scp
    (with segments: another recording cut), utt2dur, text (another WER) and utt2spk (another speaker) silently."""
    from snakeshard.core.data import read_items
    from snakeshard.errors import DataError

    wav = PROJECT / "data/demo/wav/cards-001.wav"
    d = tmp_path / "d"
    d.mkdir()
    segmented = table == "wav.scp"
    (d / "wav.scp").write_text("".join(f"r{n} {wav}\n" for n in range(3)) + (f"r1 {wav}\n" if segmented else ""))
    if segmented:
        (d / "segments").write_text("".join(f"r{n}-u r{n} 0 0.5\n" for n in range(3)))
    else:
        lines = {"utt2dur": "{} 1.0", "text": "{} some words", "utt2spk": "{} spk"}[table]
        (d / table).write_text("".join(lines.format(f"r{n}") + "\n" for n in range(3)) + lines.format("r1") + "\n")
    with pytest.raises(DataError) as error:
        read_items({"path": str(d)})
    assert str(error.value) == f"1 duplicate key(s): 'r1' ({d / table}:4, first at {d / table}:2)"


# -- keep_together: a speaker's or a recording's keys in one shard, as Kaldi's split_data.sh ------------------

def speakers_dir(path: Path, speakers: dict[str, int], segments: bool = False) -> dict:
    """A Kaldi dir whose speaker s has ``speakers[s]`` utterances of 1 s (speaker-prefixed ids, as Kaldi sorts
    them), with utt2spk; ``segments``: each speaker's utterances cut from one recording of theirs."""
    path.mkdir(parents=True, exist_ok=True)
    utts = [(f"{s}-{i:02d}", s) for s, n in speakers.items() for i in range(n)]
    (path / "utt2spk").write_text("".join(f"{u} {s}\n" for u, s in utts))
    if segments:
        (path / "wav.scp").write_text("".join(f"{s}-rec {DEMO_WAV}\n" for s in speakers))
        (path / "segments").write_text("".join(f"{u} {s}-rec 0 1\n" for u, s in utts))
    else:
        (path / "wav.scp").write_text("".join(f"{u} {DEMO_WAV}\n" for u, _ in utts))
        (path / "utt2dur").write_text("".join(f"{u} 1.0\n" for u, _ in utts))
    return {"path": str(path), "format": "kaldi"}


def groups_of(keys: list[list[str]]) -> list[list[str]]:
    return [sorted({k.split("-")[0] for k in shard}) for shard in keys]


SPEAKERS = {"awb": 8, "kal": 8, "rms": 3, "slt": 13}  # 32 utterances, as a Kaldi user's trial split them


@pytest.mark.parametrize("sharding, expected", [
    # without it, shard_size 5 cut awb 5+3, kal 2+5+1, slt 1+5+2 (the trial's per-speaker CMN used 1-5 of 8)
    ({"shard_size": 5}, [["awb"], ["awb", "kal"], ["kal"], ["kal", "rms", "slt"], ["slt"], ["slt"], ["slt"]]),
    ({"shard_size": 5, "keep_together": "spk"}, [["awb"], ["kal"], ["rms"], ["slt"]]),
    ({"shard_size": 11, "keep_together": "spk"}, [["awb"], ["kal", "rms"], ["slt"]]),
    ({"num_shards": 2, "keep_together": "spk"}, [["awb", "kal"], ["rms", "slt"]]),
    ({"num_shards": 9, "keep_together": "spk"}, [["awb"], ["kal"], ["rms"], ["slt"]]),  # at most one per speaker
    ({"shard_seconds": 12, "keep_together": "spk"}, [["awb"], ["kal", "rms"], ["slt"]]),
    ({"shard_seconds": 12, "keep_together": "rec"}, [["awb"], ["kal", "rms"], ["slt"]]),
], ids=["no-groups", "size5", "size11", "num2", "num9", "seconds12", "rec"])
def test_keep_together_cuts_only_between_speakers_or_recordings(tmp_path, sharding, expected):
    segmented = sharding.get("keep_together") == "rec"
    plan, keys = planned(speakers_dir(tmp_path / "d", SPEAKERS, segments=segmented), sharding)
    assert groups_of(keys) == expected
    assert sum(map(len, keys)) == 32 and plan["num_shards"] == len(expected)


def test_keep_together_over_json_lines_and_its_errors(tmp_path):
    path = tmp_path / "m.jsonl"

    def write(rows):
        path.write_text("".join(json.dumps({"key": k, "audio": str(DEMO_WAV), "duration": 1, **extra}) + "\n"
                                for k, extra in rows))
        return {"path": str(path), "format": "jsonl"}

    spec = write([(f"u{i}", {"meeting": f"m{i // 3}"}) for i in range(9)])
    _, keys = planned(spec, {"num_shards": 2, "keep_together": "meeting"})
    assert keys == [["u0", "u1", "u2", "u3", "u4", "u5"], ["u6", "u7", "u8"]]
    with pytest.raises(DataError, match=rf"^sharding.keep_together: key 'u4' \({path}:5\) has no 'meeting'; every "):
        planned(write([(f"u{i}", {"meeting": "m"} if i != 4 else {}) for i in range(9)]), {"shard_size": 2,
                                                                                         "keep_together": "meeting"})
    with pytest.raises(DataError, match=rf"^sharding.keep_together: meeting 'a' of key 'u2' \({path}:3\) comes back "
                                        rf"after other values \(its first key: 'u0' \({path}:1\)\): keep_together "):
        planned(write([("u0", {"meeting": "a"}), ("u1", {"meeting": "b"}), ("u2", {"meeting": "a"})]),
                {"shard_size": 2, "keep_together": "meeting"})


def test_keep_together_refuses_a_speaker_without_utt2spk_line_or_split_across_lines(tmp_path):
    spec = speakers_dir(tmp_path / "d", {"awb": 2, "kal": 2})
    utt2spk = Path(spec["path"]) / "utt2spk"
    utt2spk.write_text("awb-00 awb\nawb-01 awb\nkal-00 kal\n")
    with pytest.raises(DataError, match=r"key 'kal-01' \(.*wav.scp:4\) has no 'spk' \(utt2spk has no line for it\)"):
        planned(spec, {"shard_size": 1, "keep_together": "spk"})
    utt2spk.write_text("awb-00 awb\nawb-01 kal\nkal-00 awb\nkal-01 kal\n")
    with pytest.raises(DataError, match=r"spk 'awb' of key 'kal-00' \(.*wav.scp:3\) comes back after other values "
                                        r"\(its first key: 'awb-00' \(.*wav.scp:1\)\)"):
        planned(spec, {"shard_size": 1, "keep_together": "spk"})
