"""Typed outputs, padded batches and chained stages, through real `snakemake` runs.

A test runner returns one value of every type the default writers take (text scalars, float32 and
float64 and int32 arrays, a torch tensor, an int64 cube written as npy, int16 audio as wav, int32
audio as 24-bit flac, a dict, a token list written as text); what kaldiio, soundfile and json read
back from the merged outputs must equal what forward returned, bit for bit, from any directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile as sf

from conftest import (copy_workflow, make_kaldi_dir, read_config, run_cli, run_snakemake, shard_process, wait_for,
                      write_config)
from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard import load_dataset
from snakeshard.errors import ShardError

TYPED_MODULE = '''
import time

import numpy as np

from snakeshard import Audio, BaseRunner, EnvironmentProvider


def values(key, rows=0):
    import torch

    n = int(key[-3:])
    rng = np.random.default_rng(n)
    return {
        "score": n / 7,
        "feats": rng.standard_normal((rows + n % 5 + 2, 3)).astype(np.float32),
        "vec64": rng.standard_normal(n % 4 + 1),
        "ids": np.arange(n % 3 + 1, dtype=np.int32),
        "emb": torch.from_numpy(rng.standard_normal(4).astype(np.float32)),
        "cube": rng.integers(0, 9, size=(2, 2, n % 3 + 1)),
        "wav": Audio(rng.integers(-2000, 2000, size=1600 + n).astype(np.int16), 16000),
        "hires": Audio(rng.integers(-2**23, 2**23, size=800).astype(np.int32) * 256, 8000),
        "info": {"n": n, "tokens": ["a", key], "ok": n % 2 == 0},
        "tokens": ["x", "y", key],
    }


class TypedProvider(EnvironmentProvider):
    def build_env_local(self):
        return {"delay": float(self.config.get("delay", 0)), "rows": int(self.config.get("rows", 0)),
                "nan_keys": set(self.config.get("nan_keys", []))}


class TypedRunner(BaseRunner):
    @staticmethod
    def forward(key, *, delay, rows, nan_keys):
        time.sleep(delay)
        out = values(key, rows)
        if key in nan_keys:
            out["feats"][1, 2] = np.nan
        return out
'''
TYPED_OUTPUTS = {"cube": {"format": "npy"}, "hires": {"format": "flac", "subtype": "PCM_24"},
                 "tokens": {"format": "text"}}
KEYS = [f"utt{i:03d}" for i in range(9)]
SET = Path("results/typed/toy")


def typed_project(root: Path, **stage) -> Path:
    wd = copy_workflow(root)
    (wd / "typed.py").write_text(TYPED_MODULE)
    make_kaldi_dir(wd / "data/toy", KEYS, Path("data/demo/wav/cards-001.wav"))
    write_config(wd, {
        "datasets": {"toy": {"path": "data/toy"}},
        "stages": {"typed": {"runner": "typed.TypedRunner", "provider": "typed.TypedProvider",
                             "datasets": ["toy"], "sharding": {"num_shards": 3}, "outputs": TYPED_OUTPUTS,
                             **stage}}})
    return wd


def expected_values(key: str, rows: int = 0) -> dict:
    namespace: dict = {}
    exec(TYPED_MODULE, namespace)
    return namespace["values"](key, rows)


def scp(path: Path) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in path.read_text().splitlines())


def test_every_type_round_trips_bit_exact_from_any_directory(tmp_path, monkeypatch):
    """9 keys in 3 shards: the merged feats/vec64/ids/emb.scp (kaldiio), cube.scp (npy), wav.scp and hires.scp
    (soundfile), info.jsonl (json), tokens and score (text) give back exactly what forward returned, in plan
    order, read from another directory; fields.json says what each field is."""
    wd = typed_project(tmp_path / "wf")
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    out = wd / SET
    monkeypatch.chdir(tmp_path)  # merged paths work from anywhere
    expected = {k: expected_values(k) for k in KEYS}

    for field in ("feats", "vec64", "ids", "emb"):
        assert list(scp(out / f"{field}.scp")) == KEYS
        loaded = kaldiio.load_scp(str(out / f"{field}.scp"))
        for k in KEYS:
            want = np.asarray(expected[k][field])
            assert loaded[k].dtype == want.dtype and np.array_equal(loaded[k], want), (field, k)
    for k, path in scp(out / "cube.scp").items():
        assert Path(path).is_absolute() and path.endswith(f"split.{KEYS.index(k) // 3}/cube/{k}.npy")
        assert np.array_equal(np.load(path), expected[k]["cube"]) and np.load(path).dtype == np.int64
    for k, path in scp(out / "wav.scp").items():
        samples, rate = sf.read(path, dtype="int16")
        assert rate == 16000 and np.array_equal(samples, expected[k]["wav"].samples)
    for k, path in scp(out / "hires.scp").items():
        samples, rate = sf.read(path, dtype="int32")
        assert path.endswith(".flac") and sf.info(path).subtype == "PCM_24" and rate == 8000
        assert np.array_equal(samples, expected[k]["hires"].samples)
    records = [json.loads(line) for line in (out / "info.jsonl").read_text().splitlines()]
    assert records == [{"key": k, "value": expected[k]["info"]} for k in KEYS]
    assert (out / "tokens").read_text() == "".join(f"{k} x y {k}\n" for k in KEYS)
    assert (out / "score").read_text() == "".join(f"{k} {expected[k]['score']}\n" for k in KEYS)
    fields = json.loads((out / "fields.json").read_text())
    assert {f: m["format"] for f, m in fields.items()} == {
        "score": "text", "feats": "ark", "vec64": "ark", "ids": "ark", "emb": "ark", "cube": "npy",
        "wav": "wav", "hires": "flac", "info": "jsonl", "tokens": "text"}
    assert fields["hires"]["subtype"] == "PCM_24" and fields["wav"]["index"] == "wav.scp"
    # the merged dir is a Kaldi data dir: wav.scp read by snakeshard's own loader
    data = load_dataset({"path": str(out)})
    assert data.keys == KEYS and np.array_equal(data.load_audio("utt004", dtype="int16")[0],
                                                expected["utt004"]["wav"].samples)
    # a data dir's fields: its records'
    (make_kaldi_dir(wd / "data/said", KEYS, Path("data/demo/wav/cards-001.wav")) / "text").write_text(
        "".join(f"{k} words of {k}\n" for k in KEYS))
    source = load_dataset({"path": str(wd / "data/said"), "name": "toy"})
    assert source.load_field("utt004", "text") == "words of utt004"
    from snakeshard.errors import DataError

    with pytest.raises(DataError, match=r"^datasets.toy: key 'utt004' has no field 'tokens' \(its record has "
                                        r"\['audio', 'key', .*'text'\]\); a field another stage wrote is read over "):
        source.load_field("utt004", "tokens")
    # what a chained stage's provider gets: every field, through the dataset
    inputs = json.loads((out / "merged.json").read_text())["inputs"]
    chained = load_dataset({"format": "stage", "path": str(out), "upstream_inputs": inputs,
                            "source": {"path": str(wd / "data/toy")}})
    assert chained.load_field("utt005", "info") == expected["utt005"]["info"]
    assert chained.load_field("utt005", "tokens") == "x y utt005"
    assert np.array_equal(chained.load_array("utt005", "cube"), expected["utt005"]["cube"])
    assert np.array_equal(chained.load_array("utt005", "feats"), expected["utt005"]["feats"])
    # writable, as torch.from_numpy wants them (kaldiio's read-only view made torch warn in a user trial)
    assert chained.load_array("utt005", "cube").flags.writeable and chained.load_array("utt005", "feats").flags.writeable
    assert np.array_equal(chained.load_audio("utt005", "hires", dtype="int32")[0], expected["utt005"]["hires"].samples)
    assert np.array_equal(chained.load_audio("utt005", dtype="int16")[0], expected["utt005"]["wav"].samples)
    from snakeshard.errors import DataError

    with pytest.raises(DataError, match=r"field 'info' is jsonl, not one of \['ark', 'npy'\]"):
        chained.load_array("utt005", "info")
    with pytest.raises(DataError, match=r"the upstream stage wrote no field 'nope' \(it has \['cube', "):
        chained.load_field("utt005", "nope")


# -- bad values: each fails its shard, naming key, field (and types); nothing half-written is kept --

class ValuesRunner(BaseRunner):
    @staticmethod
    def forward(key, *, table):
        return table[key]


class TableProvider(EnvironmentProvider):
    def build_env_local(self):
        return {"table": self.config["table"]}


def run_table(tmp_path, table: dict, **options):
    keys = list(table)
    runner = ValuesRunner(TableProvider({"table": table}), output_dir=tmp_path / "split.0")
    from snakeshard.core.shard import run_shard

    return run_shard(ValuesRunner, runner.provider.build_env_local(), keys, tmp_path / "split.0", progress=False,
                     **options)


def test_nan_in_an_array_fails_naming_key_and_field_unless_allowed(tmp_path):
    """A NaN at [1, 2] of k1's feats: ShardError naming k1, feats and the flat index, no done; with feats under
    allow_nonfinite the shard is done and the NaN is in the ark. An inf in an npy field or audio fails the same way."""
    good, bad = np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)
    bad[1, 2] = np.nan
    table = {"k0": {"feats": good}, "k1": {"feats": bad}}
    with pytest.raises(ShardError, match=r"shard 0: item 'k1': field 'feats' holds nan \(flat index 6\).*allow_nonfinite"):
        run_table(tmp_path, table)
    assert not (tmp_path / "split.0/done").exists()
    run_table(tmp_path, table, allow_nonfinite=["feats"])
    loaded = kaldiio.load_scp(str(tmp_path / "split.0/feats.scp"))
    assert np.isnan(loaded["k1"][1, 2]) and (tmp_path / "split.0/done").exists()
    inf = np.full(3, np.inf)
    with pytest.raises(ShardError, match=r"item 'k0': field 'x' holds inf"):
        run_table(tmp_path, {"k0": {"x": inf}}, outputs={"x": {"format": "npy"}})
    from snakeshard import Audio

    with pytest.raises(ShardError, match=r"item 'k0': field 'w' holds -inf"):
        run_table(tmp_path, {"k0": {"w": Audio(-inf.astype(np.float32), 16000)}})
    with pytest.raises(ShardError, match=r"item 'k0': field 'j' holds a NaN or infinity"):
        run_table(tmp_path, {"k0": {"j": {"loss": math.nan}}})


def test_compressed_ark_is_smaller_and_close(tmp_path):
    """outputs: {feats: {format: ark, compression_method: 2}}: a Kaldi-compressed matrix (kaldiio), under a third
    of the plain ark's size, within 1% of the range of the values; fields.json-to-be records the option."""
    values = np.random.default_rng(0).standard_normal((200, 40)).astype(np.float32)
    done = run_table(tmp_path, {"k0": {"feats": values}}, outputs={"feats": {"format": "ark", "compression_method": 2}})
    loaded = kaldiio.load_scp(str(tmp_path / "split.0/feats.scp"))["k0"]
    assert (tmp_path / "split.0/feats.ark").stat().st_size < values.nbytes / 3
    assert np.abs(loaded - values).max() <= 0.01 * (values.max() - values.min())
    assert done["fields"]["feats"]["compression_method"] == 2


@pytest.mark.parametrize("first, later, message", [
    (np.zeros(2, np.float32), "text", r"item 'k1': field 'f' is a str \(scalar\), but earlier keys of this shard gave it array values"),
    ({"a": 1}, np.zeros(2), r"item 'k1': field 'f' is a ndarray \(array\), but earlier keys .* gave it json values"),
    (1.5, [1, 2], r"item 'k1': field 'f' is a list \(json\), but earlier keys .* gave it scalar values"),
])
def test_a_field_that_changes_type_between_keys_fails_naming_both(tmp_path, first, later, message):
    with pytest.raises(ShardError, match=message):
        run_table(tmp_path, {"k0": {"f": first}, "k1": {"f": later}})
    assert not (tmp_path / "split.0/done").exists()


@pytest.mark.parametrize("table, options, message", [
    ({"k0": {"f": np.zeros((2, 2, 2), np.float32)}}, {},
     r"item 'k0': field 'f' is a float32 array of shape \(2, 2, 2\): a Kaldi ark holds .*outputs\.f\.format: npy"),
    ({"k0": {"f": np.zeros(3, np.int64)}}, {}, r"field 'f' is a int64 array"),
    ({"k0": {"f": np.zeros(3)}}, {"outputs": {"f": {"format": "wav"}}},
     r"item 'k0': field 'f' is a ndarray, which format 'wav' .* cannot hold"),
    ({"a/b": {"w": np.zeros(3)}}, {"outputs": {"w": {"format": "npy"}}},
     r"item 'a/b': field 'w' writes one file per key, and this key cannot be a file name"),
    ({"k0": {"f": 1}, "k1": {"g": 2}}, {}, r"field 'f' has values for 1 of the shard's 2 keys \(missing: \['k1'\]\)"),
    ({"k0": {"f": object()}}, {}, r"item 'k0': field 'f' is a object; the default writers take"),
    ({"k0": {"split.0": 1}}, {}, r"item 'k0': result field 'split.0' cannot be used as a file name"),
])
def test_values_no_writer_can_take_fail_with_the_fix(tmp_path, table, options, message):
    """A 3-D float array (ark holds 1-D/2-D), an int64 array, an array forced into wav, a key that is no file name,
    a field only some keys return, an object, a field named like a shard dir: each fails naming key and field,
    no done."""
    with pytest.raises(ShardError, match=message):
        run_table(tmp_path, table, **options)
    assert not (tmp_path / "split.0/done").exists()


# -- padded batches --

def test_collate_pads_and_unbatch_cuts_back_numpy_and_torch():
    from snakeshard.io.batch import collate, unbatch

    items = [np.arange(3 * 2, dtype=np.float32).reshape(3, 2), np.ones((1, 2), np.float32), np.zeros((4, 2), np.float32)]
    b = collate(items, keys=["a", "b", "c"], pad_value=-1)
    assert b.data.shape == (3, 4, 2) and b.lengths.tolist() == [3, 1, 4] and b.keys == ["a", "b", "c"]
    assert b.mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert (b.data[1, 1:] == -1).all()
    assert all(np.array_equal(x, y) for x, y in zip(unbatch(b.data, b.lengths), items))
    with pytest.raises(ValueError, match=r"item 'y' is float32 \(2, 3\), the first is float32 \(3, 2\)"):
        collate([items[0], np.zeros((2, 3), np.float32)], keys=["x", "y"])
    torch = pytest.importorskip("torch")
    t = collate([torch.from_numpy(x) for x in items])
    assert isinstance(t.data, torch.Tensor) and t.mask.tolist() == b.mask.tolist()
    assert all(torch.equal(x, torch.from_numpy(y)) for x, y in zip(unbatch(t.data, t.lengths), items))


def test_plan_batches_by_count_seconds_and_sorted():
    from snakeshard.io.batch import padding_ratio, plan_batches

    lengths = [3.0, 1.0, 5.0, 1.0, 2.0]
    assert plan_batches(lengths, batch_size=2) == [[0, 1], [2, 3], [4]]
    assert plan_batches(lengths, batch_seconds=4) == [[0, 1], [2], [3, 4]]  # 5 s stands alone
    assert plan_batches(lengths, batch_seconds=6, sort_by_length=True) == [[2], [0, 4, 1], [3]]  # longest first
    assert plan_batches(lengths, batch_seconds=100, batch_size=2) == [[0, 1], [2, 3], [4]]
    assert padding_ratio(lengths, [[0, 1], [2], [3, 4]]) == pytest.approx(1 - 12 / 15)


FBANK_STAGE = {"runner": "snakeshard.stages.fbank.FbankRunner", "provider": "snakeshard.stages.fbank.FbankProvider",
               "provider_config": {"num_mel_bins": 80}, "datasets": ["demo"], "sample_rate": 16000,
               "sharding": {"num_shards": 2}}
BATCHINGS = {"plain": {"batch_size": None}, "count": {"batch_size": 3}, "seconds": {"batch_seconds": 8},
             "seconds_sorted": {"batch_seconds": 8, "sort_by_length": True},
             "count_sorted": {"batch_size": 4, "sort_by_length": True}}


def set_files(set_dir: Path) -> dict[str, bytes]:
    """Every merged file and shard ark of a set, with the set's own path taken out of scp lines."""
    files = {}
    for path in sorted(set_dir.glob("*")) + sorted(set_dir.glob("split.*/*.ark")):
        if path.is_file() and path.name not in ("merged.json", "spec.json", "fingerprints.json", "plan.json",
                                                "stage_history.json", "audio_files.json", "summary.html"):
            files[str(path.relative_to(set_dir))] = path.read_bytes().replace(str(set_dir.resolve()).encode(), b"SET")
    return files


def test_fbank_batched_by_count_and_seconds_sorted_or_not_is_byte_identical_to_unbatched(tmp_path):
    """The fbank stage five ways in one run (no batching; batch_size 3; batch_seconds 8; both sorted): the merged
    feats.scp (set path aside), utt2num_frames, fields.json and every shard's ark are byte-identical; the sorted
    runs' logs report their padding; the features are 80-dim float32 Kaldi fbank of each utterance."""
    wd = copy_workflow(tmp_path / "wf")
    config = read_config(wd)
    config["stages"] = {f"fbank_{name}": {**FBANK_STAGE, **batching} for name, batching in BATCHINGS.items()}
    config["datasets"] = {"demo": config["datasets"]["demo"]}  # the chained ones name stages this run has not
    write_config(wd, config)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    sets = {name: set_files(wd / f"results/fbank_{name}/demo") for name in BATCHINGS}
    assert len(sets["plain"]) == 5  # feats.scp, utt2num_frames, fields.json, 2 arks
    for name, files in sets.items():
        assert files == sets["plain"], name
    log = (wd / "results/fbank_seconds_sorted/demo/logs/split.0.log").read_text()
    assert re.search(r"shard 0 .*: 6 items in \d+ batches \(batch_seconds 8, sorted by length\); padding \d+\.\d% "
                     r"of the batched length", log)
    feats = kaldiio.load_scp(str(wd / "results/fbank_plain/demo/feats.scp"))
    frames = dict(line.split() for line in (wd / "results/fbank_plain/demo/utt2num_frames").read_text().splitlines())
    from snakeshard.stages.fbank import compute_fbank, fbank_options

    samples, _ = sf.read(wd / "data/demo/wav/cards-002.wav", dtype="int16")
    direct = compute_fbank(samples.astype(np.float32), fbank_options({"num_mel_bins": 80}, 16000))
    assert feats["cards-002"].shape == (int(frames["cards-002"]), 80) and np.array_equal(feats["cards-002"], direct)


# -- kill -9 mid-write of an ark --

def test_kill9_mid_ark_write_then_rerun_is_byte_identical(tmp_path):
    """Shard 0 killed with -9 once its feats.ark holds some records (big arrays, 0.3 s per key): no done, no merge;
    the rerun's merged outputs and arks equal those of an uninterrupted run in another directory, byte for byte."""
    stage = {"provider_config": {"delay": 0.3, "rows": 3000}, "fingerprint_ignore": ["delay"]}
    clean = typed_project(tmp_path / "clean", **stage)
    assert run_snakemake(clean).returncode == 0
    wd = typed_project(tmp_path / "wf", **stage)
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"],
                              cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = wait_for(lambda: shard_process(wd, 0), 60, "shard 0 to start")
    ark = wd / SET / "split.0/feats.ark"
    wait_for(lambda: ark.exists() and ark.stat().st_size > 0, 60, "shard 0 to write into its ark")
    victim.send_signal(signal.SIGKILL)
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode != 0, out
    assert not (wd / SET / "split.0/done").exists() and not (wd / SET / "merged.json").exists()
    rerun = run_snakemake(wd)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert set_files(wd / SET) == set_files(clean / SET)


def test_kill9_of_a_forced_rerun_of_one_shard_leaves_no_merge_that_looks_current(tmp_path):
    """A finished set, then `snakemake <its split.1/done> --forcerun shard_typed` killed with -9 once the job has
    emptied the shard (a user trial: the merged feats.scp then pointed at a deleted ark while status said "merged:
    yes, current" and `snakemake -n` had nothing to do). The job removes merged.json before the shard's files:
    status says the set is not merged, a reader is refused, `snakemake -n` merges again, and the rerun's files equal
    the first run's."""
    from snakeshard.core.merge import StaleMergedOutput, require_current

    wd = typed_project(tmp_path / "wf", provider_config={"delay": 0.3, "rows": 3000}, fingerprint_ignore=["delay"])
    assert run_snakemake(wd).returncode == 0
    first = set_files(wd / SET)
    inputs = json.loads((wd / SET / "merged.json").read_text())["inputs"]
    forced = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "1",
                               str(SET / "split.1/done"), "--forcerun", "shard_typed"],
                              cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = wait_for(lambda: shard_process(wd, 1), 60, "shard 1 to start")
    attempt, ark = wd / SET / "split.1/.attempt", wd / SET / "split.1/feats.ark"
    wait_for(lambda: attempt.read_text().startswith(f"{victim.pid}:") and ark.exists() and ark.stat().st_size > 0,
             60, "shard 1 to claim its dir and write into its new ark")
    victim.send_signal(signal.SIGKILL)
    out, _ = forced.communicate(timeout=120)
    assert forced.returncode != 0, out
    assert not (wd / SET / "merged.json").exists() and not (wd / SET / "split.1/done").exists()
    status = run_cli(wd, "status").stdout
    assert "  merged: no" in status and "split.1     incomplete" in status, status
    with pytest.raises(StaleMergedOutput, match="is not merged"):
        require_current(wd / SET, inputs)
    dry = run_snakemake(wd, "-n")
    assert "shard_typed        1" in dry.stdout and "merge              1" in dry.stdout, dry.stdout
    assert run_snakemake(wd).returncode == 0
    assert set_files(wd / SET) == first


# -- chained stages --

FRAMES_MODULE = '''
from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard import load_dataset


class FramesProvider(EnvironmentProvider):
    def build_env_local(self):
        return {"dataset": load_dataset(self.config["dataset"]), "scale": float(self.config.get("scale", 1))}


class FramesRunner(BaseRunner):
    """Per key: the number of upstream feature frames and their scaled mean, and the upstream's text field."""

    @staticmethod
    def forward(key, *, dataset, scale):
        feats = dataset.load_array(key, "feats")
        return {"frames": len(feats), "mean": round(float(feats.mean()) * scale, 4),
                "upstream_frames": dataset.load_field(key, "utt2num_frames")}
'''


def chained_project(root: Path) -> Path:
    wd = copy_workflow(root)
    (wd / "frames.py").write_text(FRAMES_MODULE)
    config = read_config(wd)
    config["datasets"] = {"demo": config["datasets"]["demo"], "demo_fbank": {"from_stage": "fbank", "dataset": "demo"}}
    config["stages"] = {
        # the downstream stage first: the config order does not matter
        "frames": {"runner": "frames.FramesRunner", "provider": "frames.FramesProvider", "datasets": ["demo_fbank"],
                   "sharding": {"num_shards": 3}},
        "fbank": {**FBANK_STAGE, "provider_config": {"num_mel_bins": 23}},
    }
    write_config(wd, config)
    return wd


def ran(proc) -> list[str]:
    return re.findall(r"^(?:local)?rule (shard_\w+):", proc.stdout + proc.stderr, re.M)


def test_chained_stage_plans_at_parse_reruns_with_its_upstream_and_refuses_a_stale_one(tmp_path):
    """fbank -> frames (a dataset from_stage fbank): `-n` on a clean tree lists 2 fbank and 3 frames shard jobs;
    the run gives frames computed from the merged feats; an edit of frames' provider config reruns only frames'
    shards; an edit of fbank's reruns both; a frames job given a stale upstream is refused, and status says why."""
    wd = chained_project(tmp_path / "wf")
    dry = run_snakemake(wd, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert sorted(ran(dry)) == ["shard_fbank"] * 2 + ["shard_frames"] * 3
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    feats = kaldiio.load_scp(str(wd / "results/fbank/demo/feats.scp"))
    lines = (wd / "results/frames/demo_fbank/mean").read_text().splitlines()
    assert lines == [f"{k} {round(float(feats[k].mean()), 4)}" for k in feats]
    assert (wd / "results/frames/demo_fbank/upstream_frames").read_text() == \
        (wd / "results/fbank/demo/utt2num_frames").read_text()

    config = read_config(wd)
    config["stages"]["frames"]["provider_config"] = {"scale": 2}
    write_config(wd, config)
    down = run_snakemake(wd)
    assert down.returncode == 0 and sorted(ran(down)) == ["shard_frames"] * 3, down.stderr[-3000:]

    config["stages"]["fbank"]["provider_config"] = {"num_mel_bins": 40}
    write_config(wd, config)
    up = run_snakemake(wd)
    assert up.returncode == 0 and sorted(ran(up)) == ["shard_fbank"] * 2 + ["shard_frames"] * 3, up.stderr[-3000:]
    assert kaldiio.load_scp(str(wd / "results/fbank/demo/feats.scp"))["cards-001"].shape[1] == 40

    # one recording of fbank's last shard changes: that shard reruns, and of frames only the shards holding its keys
    # (a frames shard job reads the fbank shards that hold its keys, and waits for those alone)
    touched = (wd / "results/fbank/demo/split.1/keys").read_text().split()
    expected = [n for n in range(3) if set(touched) & set((wd / f"results/frames/demo_fbank/split.{n}/keys").read_text().split())]
    assert 0 < len(expected) < 3, expected  # the plans overlap so that the test tells
    before = [(wd / f"results/frames/demo_fbank/split.{n}/done").read_bytes() for n in range(3)]
    os.utime(wd / f"data/demo/wav/{touched[-1]}.wav", ns=(time.time_ns(), time.time_ns()))
    part = run_snakemake(wd)
    assert part.returncode == 0, part.stderr[-3000:]
    assert sorted(ran(part)) == ["shard_fbank"] + ["shard_frames"] * len(expected), part.stderr[-3000:]
    after = [(wd / f"results/frames/demo_fbank/split.{n}/done").read_bytes() for n in range(3)]
    assert [n for n in range(3) if after[n] != before[n]] == expected
    lines = (wd / "results/frames/demo_fbank/mean").read_text().splitlines()
    feats = kaldiio.load_scp(str(wd / "results/fbank/demo/feats.scp"))
    assert lines == [f"{k} {round(float(feats[k].mean()) * 2, 4)}" for k in feats]  # scale: 2, set above

    # upstream edited again, parsed (spec.json and fingerprints now expect the new upstream), not rerun
    config["stages"]["fbank"]["provider_config"] = {"num_mel_bins": 30}
    write_config(wd, config)
    assert run_snakemake(wd, "-n").returncode == 0
    status = run_cli(wd, "status").stdout
    assert re.search(r"stage frames, dataset demo_fbank: 3 shards\n  split\.0 +stale .*changed since it ran: "
                     r"the upstream stage's output for its keys", status), status
    record = json.loads((wd / "results/frames/demo_fbank/fingerprints.json").read_text())
    job = subprocess.run([sys.executable, "-m", "snakeshard", "run-shard", "--shard", "0",
                          "--spec", "results/frames/demo_fbank/spec.json", "--shard-dir", str(tmp_path / "probe"),
                          "--fingerprint", record["stage"]], cwd=wd, capture_output=True, text=True)
    assert job.returncode == 1
    assert "results/fbank/demo: the merged output is stale" in job.stderr and "refusing to read it" in job.stderr
    # a frames shard job as its rule runs it: the fbank shards holding its keys are stale, refused before any item
    from snakeshard.core.fingerprint import shard_inputs_text

    entry = record["shards"][0]
    inputs = shard_inputs_text(record["stage"], entry["keys"], entry["records"], entry["audio"], entry["upstream"])
    job = subprocess.run([sys.executable, "-m", "snakeshard", "run-shard", "--shard", "0",
                          "--spec", "results/frames/demo_fbank/spec.json", "--shard-dir", str(tmp_path / "probe0"),
                          "--shard-inputs", inputs], cwd=wd, capture_output=True, text=True)
    assert job.returncode == 1 and not (tmp_path / "probe0/done").exists()
    assert re.search(r"results/fbank/demo: the output of split\.0\.\.split\.\d is stale: .*refusing to read it",
                     job.stderr), job.stderr


def test_a_downstream_edit_and_an_unrelated_upstream_rerun_in_one_run_redo_exactly_their_shards(tmp_path):
    """fbank (fingerprint: wav.scp only) -> frames (every record): one key's text changes in frames' first shard and
    one recording of fbank's last shard is touched. One run redoes fbank's last shard, the frames shards over its
    keys and the frames shard holding the edited key, and merges (Snakemake skips its own checks of jobs below a
    job that reruns: a frames canary behind fbank's merge once hid the edited shard, and the merge refused it)."""
    wd = chained_project(tmp_path / "wf")
    config = read_config(wd)
    config["stages"]["fbank"]["fingerprint"] = {"records": ["wav.scp"]}
    config["stages"]["frames"]["sharding"] = {"shard_size": 2}  # 5 shards over fbank's 2
    write_config(wd, config)
    assert run_snakemake(wd).returncode == 0
    shards = range(5)
    frames = [(wd / f"results/frames/demo_fbank/split.{n}/keys").read_text().split() for n in shards]
    touched = (wd / "results/fbank/demo/split.1/keys").read_text().split()
    edited = frames[0][0]
    expected = sorted({n for n in shards if set(touched) & set(frames[n])} | {0})
    assert len(expected) < 4, (frames, touched)  # at least one frames shard has no reason to run
    before = [(wd / f"results/frames/demo_fbank/split.{n}/done").read_bytes() for n in shards]
    text = wd / "data/demo/text"
    text.write_text("".join(line + (" edited" if line.split()[0] == edited else "") + "\n"
                            for line in text.read_text().splitlines()))
    os.utime(wd / f"data/demo/wav/{touched[-1]}.wav", ns=(time.time_ns(), time.time_ns()))
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(ran(run)) == ["shard_fbank"] + ["shard_frames"] * len(expected), run.stderr[-3000:]
    after = [(wd / f"results/frames/demo_fbank/split.{n}/done").read_bytes() for n in shards]
    assert [n for n in shards if after[n] != before[n]] == expected


@pytest.mark.parametrize("datasets, message", [
    ({"d": {"from_stage": "nope", "dataset": "demo"}}, r"datasets\.d\.from_stage: 'nope' is not a stage"),
    ({"d": {"from_stage": "fbank", "dataset": "other"}}, r"datasets\.d\.dataset: stage 'fbank' runs over \['demo'\], not 'other'"),
    ({"d": {"from_stage": "fbank", "dataset": "demo", "path": "x"}}, r"datasets\.d: give either path .* or from_stage"),
    ({"d": {"from_stage": "frames", "dataset": "d"}}, r"stage 'frames' reads its own output \(d\)"),
    ({"d": {"path": "data/demo", "dataset": "demo"}}, r"datasets\.d\.dataset: only a from_stage dataset names"),
])
def test_chained_dataset_config_errors_name_the_key(tmp_path, datasets, message):
    wd = chained_project(tmp_path / "wf")
    config = read_config(wd)
    config["datasets"].update(datasets)
    config["stages"]["frames"]["datasets"] = ["d"]
    write_config(wd, config)
    dry = run_snakemake(wd, "-n")
    assert dry.returncode != 0 and re.search(message, dry.stdout + dry.stderr), dry.stdout[-2000:]


@pytest.mark.parametrize("option, message", [
    ({"threshold": "high"}, "stages.vad.provider_config.threshold: a speech probability between 0 and 1 (default "
                            "0.5), got 'high'"),
    ({"speech_pad_ms": -30}, "stages.vad.provider_config.speech_pad_ms: milliseconds, a number >= 0 (default 30), "
                             "got -30"),
    ({"threads": 1.5}, "stages.vad.provider_config.threads: torch threads per job, an integer >= 1"),
])
def test_a_bad_vad_option_is_refused_at_parse_naming_it(tmp_path, option, message):
    """The shipped vad stage's options checked when snakemake reads the workflow (a user trial: `threshold: high`
    passed `-n`, and the canary failed inside silero-vad with a TypeError); nothing runs."""
    wd = copy_workflow(tmp_path / "wf")
    config = read_config(wd)
    config["stages"]["vad"]["provider_config"] = {**(config["stages"]["vad"].get("provider_config") or {}), **option}
    write_config(wd, config)
    dry = run_snakemake(wd, "-n")
    assert dry.returncode == 1 and f"snakeshard: error: {message}" in dry.stderr, dry.stderr[-2000:]


def test_vad_output_dir_is_a_kaldi_data_dir(tmp_path):
    """The shipped vad stage (silero-vad, padded batches by seconds): its merged output dir reads through
    snakeshard.load_dataset (wav.scp of speech-trimmed audio, no longer than the source), its segments lie
    inside each recording, and speech_prob.scp holds one probability per 512 samples (kaldiio)."""
    pytest.importorskip("silero_vad")
    wd = copy_workflow(tmp_path / "wf")
    run = run_snakemake(wd, "results/vad/demo/merged.json")
    assert run.returncode == 0, run.stderr[-3000:]
    out = wd / "results/vad/demo"
    trimmed = load_dataset({"path": str(out), "format": "kaldi"})
    source = load_dataset({"path": str(wd / "data/demo")})
    assert trimmed.keys == source.keys
    probs = kaldiio.load_scp(str(out / "speech_prob.scp"))
    segments = {r["key"]: r["value"] for r in map(json.loads, (out / "speech.jsonl").read_text().splitlines())}
    for key in source.keys:
        cut, _ = trimmed.load_audio(key)
        whole, rate = source.load_audio(key)
        assert 0 < len(cut) <= len(whole)
        assert probs[key].shape == (math.ceil(len(whole) / 512),) and probs[key].dtype == np.float32
        assert segments[key] and all(0 <= s["start"] < s["end"] <= len(whole) / rate for s in segments[key])
        # the cut runs from the first onset to the last offset (segment times are rounded to the millisecond)
        assert abs(len(cut) - (segments[key][-1]["end"] - segments[key][0]["start"]) * rate) <= 16


@pytest.mark.parametrize("stage, message", [
    ({"outputs": {"cube": {"format": "zip"}}}, r"stages\.typed\.outputs\.cube\.format: 'zip' is not one of"),
    ({"outputs": {"cube": {"format": "ark", "subtype": "PCM_16"}}},
     r"stages\.typed\.outputs\.cube\.subtype: format 'ark' takes \['compression_method'\]"),
    ({"outputs": {"done": {"format": "text"}}}, r"stages\.typed\.outputs\.done: 'done' cannot be a result field's file name"),
    ({"sort_by_length": True}, r"stages\.typed\.sort_by_length: sorting needs batches: set batch_size or batch_seconds"),
    ({"batch_seconds": 0}, r"stages\.typed\.batch_seconds: 0 is less than or equal to the minimum of 0"),
])
def test_bad_output_and_batching_config_fails_the_dry_run_naming_the_key(tmp_path, stage, message):
    wd = typed_project(tmp_path / "wf", **stage)
    dry = run_snakemake(wd, "-n")
    assert dry.returncode != 0 and re.search(message, dry.stdout + dry.stderr), dry.stdout[-2000:]


def test_shipped_chain_an_upstream_edit_reruns_its_consumers_and_nothing_else(tmp_path):
    """The shipped config (fbank over demo_vad = vad's output, and over demo): a vad threshold edit reruns vad's 2
    shards and fbank's 2 shards over demo_vad; fbank's shards over demo and asr's keep their done files."""
    pytest.importorskip("silero_vad")
    wd = copy_workflow(tmp_path / "wf")
    config = read_config(wd)
    # the chained dataset first: the canary must still be over demo, or it would rerun with vad and take
    # fbank's demo shards with it
    config["stages"]["fbank"]["datasets"] = ["demo_vad", "demo"]
    write_config(wd, config)
    assert run_snakemake(wd).returncode == 0
    kept = {p: p.read_bytes() for p in (wd / "results").glob("*/demo/split.*/done") if "/vad/" not in str(p)}
    config = read_config(wd)
    config["stages"]["vad"]["provider_config"] = {"threshold": 0.6}
    write_config(wd, config)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(ran(run)) == ["shard_fbank"] * 2 + ["shard_vad"] * 2
    assert all(p.read_bytes() == data for p, data in kept.items()) and len(kept) == 4  # asr 2, fbank/demo 2


def test_chained_stages_that_loop_fail_the_dry_run_naming_the_loop(tmp_path):
    """frames reads fbank's output over d1 and fbank reads frames' output over d2: the chain names both links."""
    wd = chained_project(tmp_path / "wf")
    config = read_config(wd)
    config["datasets"] = {"d1": {"from_stage": "frames", "dataset": "d2"}, "d2": {"from_stage": "fbank", "dataset": "d1"}}
    config["stages"]["frames"]["datasets"] = ["d2"]
    config["stages"]["fbank"]["datasets"] = ["d1"]
    write_config(wd, config)
    dry = run_snakemake(wd, "-n")
    assert dry.returncode != 0 and "datasets: chained stages form a loop: frames/d2 -> fbank/d1 -> frames/d2" in \
        dry.stdout + dry.stderr, dry.stdout[-2000:]


class LengthFails(BaseRunner):
    @staticmethod
    def forward(keys, *, table):
        return [table[k] for k in keys]

    @staticmethod
    def item_length(key, **env):
        raise KeyError(f"no duration for {key}")


def test_an_item_length_that_raises_fails_the_shard_naming_the_key(tmp_path):
    from snakeshard.core.shard import run_shard

    with pytest.raises(ShardError, match=r"shard 0: item 'k0': its length for batching: KeyError: 'no duration for k0'"):
        run_shard(LengthFails, {"table": {"k0": {"x": 1}}}, ["k0"], tmp_path / "s", batch_seconds=5, progress=False)
    assert not (tmp_path / "s/done").exists()


def test_field_names_are_file_names_under_at_most_one_group_dir():
    """writers.usable_field_name (str methods: a job does without re) takes exactly the names of the rule:
    letters, digits, _ . - not starting with . or -, at most one group/ dir, not split.N or a set dir's file."""
    import re

    from snakeshard.io.writers import RESERVED_NAMES, usable_field_name

    rule = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")
    names = ["text", "hyp_1", "feats.ark", "a-b", "_x", "9", "collect_feats/feats", "g/x.y", "", ".hidden", "-x",
             "a b", "tab\tx", "é", "ü/x", "a/", "/a", "a//b", "a/b/c", "g/.x", "split.0", "split.12/x", "split.",
             "split.x", "splits.0", "split.٣", "done", "keys/x", "logs", "fields.json", "x\n", "ok.", "a..b"]
    for name in names:
        expected = (bool(rule.fullmatch(name)) and name.split("/")[0] not in RESERVED_NAMES
                    and not re.fullmatch(r"split\.\d+", name.split("/")[0]))
        assert usable_field_name(name) is expected, name


def test_a_merged_file_deleted_upstream_remakes_that_merge_and_status_says_the_chained_set_stays_current(tmp_path):
    """A merged file of fbank deleted after the run: Snakemake merges fbank again from its shards, and frames, whose
    jobs read fbank's shards (not its merge), is not made again; status says so (a user trial: it said frames was
    made again, while snakemake -n listed fbank's merge alone)."""
    wd = chained_project(tmp_path / "wf")
    assert run_snakemake(wd).returncode == 0
    frames_merged = (wd / "results/frames/demo_fbank/merged.json").stat().st_mtime_ns
    (wd / "results/fbank/demo/utt2num_frames").unlink()
    status = run_cli(wd, "status").stdout
    sets = status.split("stage frames, dataset demo_fbank")
    assert "merged: yes, current" in sets[1] and "made again" not in sets[1], status
    dry = run_snakemake(wd, "-n")
    assert dry.returncode == 0 and ran(dry) == [], dry.stderr[-3000:]
    assert re.findall(r"^(?:local)?rule (merge|report):", dry.stdout, re.M) == ["merge"], dry.stdout[-3000:]
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (wd / "results/frames/demo_fbank/merged.json").stat().st_mtime_ns == frames_merged
    assert run_cli(wd, "status").stdout.count("merged: yes, current") == 2
