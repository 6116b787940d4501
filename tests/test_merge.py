"""Merge validation over shard dirs produced in-process by run_shard: refuse anything incomplete or inconsistent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snakeshard import BaseRunner
from snakeshard.core.fingerprint import inputs_digest, shard_fingerprint
from snakeshard.core.merge import merge_set as merge_with_fingerprints
from snakeshard.core.plan import ensure_plan
from snakeshard.core.shard import run_shard
from snakeshard.core.shard_files import read_shard_keys
from snakeshard.errors import MergeError

STAGE_FP = "stagefp0123456789abc"
KEYS = [f"utt{i:02d}" for i in range(10)]


class UpperRunner(BaseRunner):
    @staticmethod
    def forward(key):
        return {"text": f"{key.upper()} words"}


class LineWriter:
    """A custom writer (no field metadata): the merge checks its fragment line by line.
    ``reverse`` writes the shard's lines last key first, as an unordered device pool would."""

    def __init__(self, shard_dir: Path, reverse: bool = False):
        self.path, self.reverse, self.lines = shard_dir / "text", reverse, []

    def write(self, result):
        self.lines.append(f"{result['key']} {result['text']}\n")

    def close(self):
        self.path.write_text("".join(reversed(self.lines) if self.reverse else self.lines))
        return ["text"]


class LineRunner(UpperRunner):
    @staticmethod
    def open_writers(shard_dir, **env):
        return LineWriter(shard_dir)


class ReversedLineRunner(UpperRunner):
    @staticmethod
    def open_writers(shard_dir, **env):
        return LineWriter(shard_dir, reverse=True)


class ScpRunner(BaseRunner):
    """Writes ``feats.scp`` (a path per key, from env) next to ``text``."""

    @staticmethod
    def forward(key, *, paths):
        return {"text": key, "feats.scp": paths[key]}


def make_set(tmp_path: Path, runner_cls=UpperRunner, env=None, num_shards: int = 3) -> tuple[Path, dict]:
    """Plan KEYS (a jsonl dataset) into shards under tmp_path/set and run every shard; returns (set_dir, plan)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"key": k}) + "\n" for k in KEYS))
    set_dir = tmp_path / "set"
    plan = ensure_plan(set_dir, {"path": str(data), "format": "jsonl"}, {"num_shards": num_shards})
    for shard in plan["shards"]:
        run_one(set_dir, shard, runner_cls, env or {})
    return set_dir, plan


def run_one(set_dir: Path, shard: dict, runner_cls, env: dict, fingerprint: str | None = None) -> None:
    shard_dir = set_dir / f"split.{shard['shard']}"
    fp = fingerprint or shard_fingerprint(STAGE_FP, shard["keys_digest"])
    run_shard(runner_cls, env, read_shard_keys(shard_dir), shard_dir, shard_id=shard["shard"], fingerprint=fp,
              progress=False)


def merge_set(set_dir: Path, plan: dict, stage_fp: str, runner_cls):
    """merge_set with the fingerprints a parse would compute for ``stage_fp`` (shard inputs: the keys only)."""
    shard_fps = [shard_fingerprint(stage_fp, s["keys_digest"]) for s in plan["shards"]]
    fingerprints = {"stage": stage_fp, "inputs": inputs_digest(shard_fps),
                    "shards": [{"fingerprint": fp} for fp in shard_fps]}
    return merge_with_fingerprints(set_dir, plan, fingerprints, runner_cls)


def refuse(set_dir: Path, plan: dict, runner_cls=UpperRunner, stage_fp: str = STAGE_FP) -> str:
    """Run merge_set expecting a MergeError; check it wrote no merged.json; return the message."""
    with pytest.raises(MergeError) as e:
        merge_set(set_dir, plan, stage_fp, runner_cls)
    assert not (set_dir / "merged.json").exists()
    return str(e.value)


def test_happy_path_concatenates_in_shard_order(tmp_path):
    """Three done shards: merged text is the shard fragments concatenated in shard order (= dataset order); merged.json written."""
    set_dir, plan = make_set(tmp_path)
    assert plan["num_shards"] == 3
    record = merge_set(set_dir, plan, STAGE_FP, UpperRunner)
    expected = b"".join((set_dir / f"split.{n}/text").read_bytes() for n in range(3))
    assert (set_dir / "text").read_bytes() == expected
    assert expected == "".join(f"{k} {k.upper()} words\n" for k in KEYS).encode()
    assert json.loads((set_dir / "merged.json").read_text()) == record == {
        "items": 10, "shards": 3, "fingerprint": STAGE_FP,
        "inputs": inputs_digest([shard_fingerprint(STAGE_FP, s["keys_digest"]) for s in plan["shards"]]),
        "files": ["text", "fields.json"], "set_dir": str(set_dir.resolve())}  # where it was made: see moved sets
    assert json.loads((set_dir / "fields.json").read_text()) == {"text": {"format": "text", "index": "text"}}


def test_merge_puts_a_reordered_fragment_in_plan_order(tmp_path):
    """A custom writer that writes its shard's keys in another order (e.g. an unordered pool): the merged
    text is in plan order all the same."""
    set_dir, plan = make_set(tmp_path, ReversedLineRunner)
    assert (set_dir / "split.1/text").read_text().splitlines() != sorted((set_dir / "split.1/text").read_text().splitlines())
    merge_set(set_dir, plan, STAGE_FP, ReversedLineRunner)
    assert (set_dir / "text").read_text() == "".join(f"{k} {k.upper()} words\n" for k in KEYS)


@pytest.mark.parametrize("edit, what", [
    (lambda lines: lines + lines[:1], "bytes, not the"),  # a duplicated line
    (lambda lines: [lines[1], lines[0], *lines[2:]], "its content changed since its shard wrote it"),  # same size
])
def test_refuses_default_fragment_changed_after_its_shard(tmp_path, edit, what):
    """A default writer's fragment edited after its shard checked it (a line added; two lines swapped, same
    size): MergeError naming the file, what differs from done's record, and the command that reruns the shard."""
    set_dir, plan = make_set(tmp_path)
    edit_fragment(set_dir / "split.1/text", edit)
    msg = refuse(set_dir, plan)
    assert f"{set_dir}/split.1/text: " in msg and what in msg
    assert f"--forcerun {set_dir}/split.1/done" in msg


def test_refuses_missing_done(tmp_path):
    """split.1/done deleted: MergeError naming shard 1 and its done path; no merged text, no merged.json."""
    set_dir, plan = make_set(tmp_path)
    (set_dir / "split.1/done").unlink()
    msg = refuse(set_dir, plan)
    assert "shard 1 is not done" in msg and f"{set_dir}/split.1/done missing" in msg
    assert "shard 0" not in msg and "shard 2" not in msg
    assert not (set_dir / "text").exists()


def test_refuses_done_with_another_fingerprint(tmp_path):
    """Shard 2 rerun under another fingerprint (config changed): MergeError naming shard 2 and both fingerprints."""
    set_dir, plan = make_set(tmp_path)
    run_one(set_dir, plan["shards"][2], UpperRunner, {}, fingerprint="0ld0ld0ld0ld0ld0ld00")
    msg = refuse(set_dir, plan)
    expected = shard_fingerprint(STAGE_FP, plan["shards"][2]["keys_digest"])
    assert "shard 2 was computed with fingerprint 0ld0ld0ld0ld0ld0ld00" in msg
    assert f"expected {expected}" in msg
    assert not (set_dir / "text").exists()


def test_refuses_when_stage_fingerprint_changed(tmp_path):
    """All shards done, but merge asked with a new stage fingerprint: MergeError listing shards 0, 1 and 2."""
    set_dir, plan = make_set(tmp_path)
    msg = refuse(set_dir, plan, stage_fp="newstagefp0000000000")
    for n in range(3):
        assert f"shard {n} was computed with fingerprint" in msg


def test_refuses_done_for_other_keys(tmp_path):
    """A done whose item count and keys digest differ from the plan: MergeError naming the shard and both counts."""
    set_dir, plan = make_set(tmp_path)
    done_path = set_dir / "split.0/done"
    done = json.loads(done_path.read_text())
    done.update(items=99, keys_digest="ffffffffffffffffffff")
    done_path.write_text(json.dumps(done))
    msg = refuse(set_dir, plan)
    assert "shard 0: done records 99 items / keys ffffffffffffffffffff" in msg
    assert f"plan has {plan['shards'][0]['items']} / {plan['shards'][0]['keys_digest']}" in msg


def edit_fragment(path: Path, edit) -> None:
    lines = path.read_text().split("\n")[:-1]
    path.write_text("".join(line + "\n" for line in edit(lines)))


def test_refuses_fragment_with_duplicate_key(tmp_path):
    """A custom writer's split.1/text repeats its first line: MergeError naming split.1/text and the duplicated key."""
    set_dir, plan = make_set(tmp_path, LineRunner)
    edit_fragment(set_dir / "split.1/text", lambda lines: lines + lines[:1])
    first = read_shard_keys(set_dir / "split.1")[0]
    msg = refuse(set_dir, plan, LineRunner)
    assert f"{set_dir}/split.1/text: duplicate key(s) [{first!r}]" in msg


def test_refuses_fragment_missing_a_key(tmp_path):
    """A custom writer's split.2/text lost its last line: MergeError naming split.2/text and the missing key."""
    set_dir, plan = make_set(tmp_path, LineRunner)
    edit_fragment(set_dir / "split.2/text", lambda lines: lines[:-1])
    msg = refuse(set_dir, plan, LineRunner)
    assert f"{set_dir}/split.2/text: missing key(s) ['utt09'] of 1" in msg


def test_refuses_fragment_with_unplanned_line(tmp_path):
    """A value with a newline written by hand into a custom writer's split.0/text: MergeError naming the file and the bogus 'key'."""
    set_dir, plan = make_set(tmp_path, LineRunner)
    edit_fragment(set_dir / "split.0/text",
                  lambda lines: [line.replace("UTT01 words", "UTT01\nsecond line") for line in lines])
    msg = refuse(set_dir, plan, LineRunner)
    assert f"{set_dir}/split.0/text: line(s) with unplanned key(s) ['second']" in msg
    assert "newline" in msg


def test_refuses_truncated_fragment(tmp_path):
    """A custom writer's split.1/text cut mid-line (no final newline): MergeError naming the file as not newline-terminated."""
    set_dir, plan = make_set(tmp_path, LineRunner)
    frag = set_dir / "split.1/text"
    frag.write_bytes(frag.read_bytes()[:-4])
    msg = refuse(set_dir, plan, LineRunner)
    assert f"{set_dir}/split.1/text: last line is not newline-terminated" in msg
    assert not (set_dir / "text").exists()


def test_refuses_missing_fragment_file(tmp_path):
    """split.2/text deleted while its done still lists it: MergeError naming split.2/text as missing."""
    set_dir, plan = make_set(tmp_path)
    (set_dir / "split.2/text").unlink()
    msg = refuse(set_dir, plan)
    assert f"{set_dir}/split.2/text: fragment missing" in msg


def test_scp_fragment_paths_are_checked(tmp_path, monkeypatch):
    """An .scp fragment pointing utt07 at a missing file: MergeError naming the key, the path and the fragment;
    once it exists, the merged scp holds absolute paths with kaldiio's offsets and ranges kept."""
    monkeypatch.chdir(tmp_path)
    Path("feats.ark").write_bytes(b"x")
    Path("feats").mkdir()
    paths = {k: "feats.ark:" + str(i * 10) for i, k in enumerate(KEYS)}  # kaldiio ark offsets
    paths["utt03"] = "feats.ark:30[0:5]"
    paths["utt05"] = "feats/utt05.npy"
    Path(paths["utt05"]).write_bytes(b"x")
    paths["utt07"] = "feats/gone.npy"
    set_dir, plan = make_set(tmp_path, ScpRunner, {"paths": paths})
    shard = next(s["shard"] for s in plan["shards"] if "utt07" in read_shard_keys(set_dir / f"split.{s['shard']}"))
    msg = refuse(set_dir, plan, ScpRunner)
    assert f"split.{shard}/feats.scp: key 'utt07' points at feats/gone.npy, which does not exist" in msg

    Path("feats/gone.npy").write_bytes(b"x")
    record = merge_set(set_dir, plan, STAGE_FP, ScpRunner)
    assert sorted(record["files"]) == ["feats.scp", "fields.json", "text"]
    # merged scp paths are absolute (relative ones are taken from the working directory)
    assert (set_dir / "feats.scp").read_text() == "".join(f"{k} {tmp_path}/{paths[k]}\n" for k in KEYS)


def test_failed_merge_after_success_leaves_no_merged_json(tmp_path):
    """Merge succeeds, then a fragment is truncated and merge runs again: it fails and no (stale) merged.json remains."""
    set_dir, plan = make_set(tmp_path)
    merge_set(set_dir, plan, STAGE_FP, UpperRunner)
    assert (set_dir / "merged.json").is_file()
    frag = set_dir / "split.1/text"
    frag.write_bytes(frag.read_bytes()[:-1])
    refuse(set_dir, plan)


class ArrayRunner(BaseRunner):
    """Writes a float32 matrix per key (ark), a wav per key and, for keys from utt05 on, ``kind`` as a dict."""

    @staticmethod
    def forward(key):
        import numpy as np

        from snakeshard import Audio

        n = int(key[3:])
        return {"feats": np.full((n + 1, 2), n, np.float32), "wav": Audio(np.full(160, n, np.int16), 16000)}


class MixedKindRunner(BaseRunner):
    """``x`` is an array in the first shard (utt00-utt02), a dict after: shards disagree on its type."""

    @staticmethod
    def forward(key):
        import numpy as np

        return {"x": np.zeros(2, np.float32) if int(key[3:]) < 3 else {"v": 1}}


def test_typed_fields_merge_to_absolute_scp_and_fields_json(tmp_path):
    """Arrays and audio from 3 shards: feats.scp and wav.scp list every key in plan order, with absolute paths
    that kaldiio and soundfile read; fields.json says ark and wav."""
    import kaldiio
    import soundfile

    set_dir, plan = make_set(tmp_path, ArrayRunner)
    merge_set(set_dir, plan, STAGE_FP, ArrayRunner)
    feats = kaldiio.load_scp(str(set_dir / "feats.scp"))
    assert list(feats) == KEYS and feats["utt07"].shape == (8, 2) and (feats["utt07"] == 7).all()
    wavs = dict(line.split() for line in (set_dir / "wav.scp").read_text().splitlines())
    assert list(wavs) == KEYS and all(Path(p).is_absolute() for p in wavs.values())
    assert (soundfile.read(wavs["utt03"], dtype="int16")[0] == 3).all()
    fields = json.loads((set_dir / "fields.json").read_text())
    assert fields == {"feats": {"format": "ark", "index": "feats.scp", "shape": [None, 2]},  # frames x 2
                      "wav": {"format": "wav", "index": "wav.scp"}}


def test_refuses_a_truncated_or_missing_ark_and_a_missing_wav(tmp_path):
    """After the shards are done: split.2's ark cut short -> its last record does not read; split.1's ark
    deleted -> named as missing; a wav of split.0 deleted -> key and path named. Each with no merged.json."""
    set_dir, plan = make_set(tmp_path, ArrayRunner)
    ark = set_dir / "split.2/feats.ark"
    ark.write_bytes(ark.read_bytes()[:-10])
    msg = refuse(set_dir, plan, ArrayRunner)
    assert f"{set_dir}/split.2/feats.scp: key 'utt09': no readable record at {ark.absolute()}:" in msg
    assert f"--forcerun {set_dir}/split.2/done" in msg

    (tmp_path / "b").mkdir()
    set_dir, plan = make_set(tmp_path / "b", ArrayRunner)
    (set_dir / "split.1/feats.ark").unlink()
    assert f"split.1/feats.scp: its ark {(set_dir / 'split.1/feats.ark').absolute()} does not exist" in \
        refuse(set_dir, plan, ArrayRunner)

    (tmp_path / "c").mkdir()
    set_dir, plan = make_set(tmp_path / "c", ArrayRunner)
    (set_dir / "split.0/wav/utt01.wav").unlink()
    assert "split.0/wav.scp: key 'utt01' points at" in refuse(set_dir, plan, ArrayRunner)


def test_refuses_a_field_whose_type_differs_between_shards(tmp_path):
    """x is an ark in shard 0 and JSON Lines in shards 1 and 2: MergeError naming the field and both."""
    set_dir, plan = make_set(tmp_path, MixedKindRunner)
    msg = refuse(set_dir, plan, MixedKindRunner)
    assert "field 'x' is {'format': 'jsonl', 'index': 'x.jsonl'} in" in msg and "but {'format': 'ark'" in msg


class FieldInSomeShards(BaseRunner):
    """``extra`` only for keys from utt03 on: shard 0 (utt00-utt02) never writes it."""

    @staticmethod
    def forward(key):
        return {"text": key, **({"extra": 1} if int(key[3:]) >= 3 else {})}


def test_refuses_a_field_one_shard_lacks(tmp_path):
    """Shards 1 and 2 wrote a field shard 0 never returned: MergeError naming shard 0's dir and the field."""
    set_dir, plan = make_set(tmp_path, FieldInSomeShards)
    msg = refuse(set_dir, plan, FieldInSomeShards)
    assert f"{set_dir}/split.0: no field 'extra', which {set_dir}/split.1 wrote" in msg


# -- state files: what finalize_state writes is checked like a field's index --

class CountRunner(UpperRunner):
    """Shard state: items and key characters (reduce_state), written by finalize_state; merge sums the shards'."""

    @staticmethod
    def init_state(**env):
        return {"items": 0, "chars": 0}

    @staticmethod
    def reduce_state(state, result, **env):
        return {"items": state["items"] + 1, "chars": state["chars"] + len(result["key"])}

    @staticmethod
    def finalize_state(state, shard_dir, **env):
        (shard_dir / "count.json").write_text(json.dumps(state))
        return ["count.json"]

    @classmethod
    def merge(cls, shard_dirs, output_dir):
        parts = [json.loads((d / "count.json").read_text()) for d in shard_dirs]
        (output_dir / "count.json").write_text(json.dumps({k: sum(p[k] for p in parts) for k in parts[0]}))
        return [*super().merge(shard_dirs, output_dir), "count.json"]


def test_state_files_are_recorded_and_merged(tmp_path):
    """finalize_state's files are listed in done with size and CRC-32; the runner's merge combines them."""
    set_dir, plan = make_set(tmp_path, CountRunner)
    done = json.loads((set_dir / "split.0/done").read_text())
    raw = (set_dir / "split.0/count.json").read_bytes()
    import zlib

    assert done["state_files"] == {"count.json": {"bytes": len(raw), "crc32": zlib.crc32(raw)}}
    record = merge_set(set_dir, plan, STAGE_FP, CountRunner)
    assert json.loads((set_dir / "count.json").read_text()) == {"items": 10, "chars": 50}
    assert record["files"] == ["text", "fields.json", "count.json"]


@pytest.mark.parametrize("damage, what", [
    (lambda p: p.write_text(p.read_text().replace('"items": 3', '"items": 4')), "changed since its shard wrote it"),
    (lambda p: p.unlink(), "missing (its done lists it)"),
])
def test_refuses_state_file_changed_or_missing(tmp_path, damage, what):
    """A state file edited (same size) or deleted after its shard: MergeError naming it and the rerun command;
    the runner's merge never reads it."""
    set_dir, plan = make_set(tmp_path, CountRunner)
    damage(set_dir / "split.2/count.json")
    msg = refuse(set_dir, plan, CountRunner)
    assert f"{set_dir}/split.2/count.json: {what}" in msg and f"--forcerun {set_dir}/split.2/done" in msg
    assert not (set_dir / "count.json").exists()
