"""A Kaldi data dir's features as a dataset: ``feats.scp`` (with or without ``wav.scp``) read by
``load_array(key, "feats")``, planned, fingerprinted (its ark files' size and mtime too) and run through the built-in
feature statistics, as a Kaldi team has them after ``steps/make_fbank.sh`` (a Kaldi user's trial: a dir of features
alone was refused for want of a wav.scp)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from conftest import copy_workflow, make_kaldi_dir, read_config, run_cli, run_snakemake, write_config
from snakeshard.core.data import KaldiDataset, read_items
from snakeshard.errors import AudioError, DataError

KEYS = [f"spk{s}-utt{u}" for s in range(3) for u in range(4)]  # 12 keys, speaker-prefixed and sorted


def features(seed: int = 0) -> dict[str, np.ndarray]:
    """Each key's frames (20-59 of 13 dims), deterministic for a seed."""
    rng = np.random.default_rng(seed)
    return {key: rng.normal(size=(20 + 3 * i, 13)).astype(np.float32) for i, key in enumerate(KEYS)}


def write_features_dir(path: Path, feats: dict, *, num_frames=True, ark: Path | None = None) -> Path:
    """A Kaldi dir as steps/make_fbank.sh leaves it, less its audio: feats.scp into one ark, text, utt2spk,
    utt2num_frames."""
    path.mkdir(parents=True, exist_ok=True)
    ark = ark or path / "raw_fbank.1.ark"
    with kaldiio.WriteHelper(f"ark,scp:{ark},{path / 'feats.scp'}") as writer:
        for key, matrix in feats.items():
            writer(key, matrix)
    (path / "text").write_text("".join(f"{k} word {k[-1]}\n" for k in feats))
    (path / "utt2spk").write_text("".join(f"{k} {k.split('-')[0]}\n" for k in feats))
    if num_frames:
        (path / "utt2num_frames").write_text("".join(f"{k} {len(m)}\n" for k, m in feats.items()))
    return path


def test_a_features_dir_gives_each_key_its_matrix_fields_and_durations(tmp_path):
    want = features()
    d = write_features_dir(tmp_path / "d", want)
    items = read_items({"path": str(d)})
    assert [i.key for i in items] == KEYS
    assert [i.audio for i in items] == [None] * 12
    assert [i.seconds for i in items] == pytest.approx([len(want[k]) * 0.01 for k in KEYS])  # Kaldi's 10 ms frames
    assert items[0].fields["spk"] == "spk0" and items[0].fields["text"] == "word 0"
    assert re.fullmatch(r".*raw_fbank\.1\.ark:\d+ \d+ \d+", items[0].records["feats.scp"])  # entry, size, mtime
    dataset = KaldiDataset({"path": str(d), "name": "feats"})
    for key in KEYS:
        got = dataset.load_array(key, "feats")
        assert got.dtype == np.float32 and np.array_equal(got, want[key]) and got.flags.writeable
    # a stage that reads audio is told why there is none
    with pytest.raises(AudioError, match=r"key 'spk0-utt0' \(.*feats\.scp:1\) has no audio: its data dir has "
                                         r"features \(feats\.scp\) and no wav\.scp"):
        dataset.load_audio("spk0-utt0")
    (d / "frame_shift").write_text("0.02\n")
    assert read_items({"path": str(d)})[1].seconds == pytest.approx(len(want[KEYS[1]]) * 0.02)


def test_a_features_dir_without_durations_shards_by_count_and_names_what_seconds_need(tmp_path):
    from snakeshard.core.data import fill_durations

    d = write_features_dir(tmp_path / "d", features(), num_frames=False)
    items = read_items({"path": str(d)})
    assert items[0].seconds is None
    with pytest.raises(DataError, match=r"key 'spk0-utt0' \(.*feats\.scp:1\): cannot read a duration from None; "
                                        r"give durations \(utt2dur, or utt2num_frames beside feats\.scp\) or shard "
                                        r"by count"):
        fill_durations(items)


def test_feats_beside_wav_scp_are_the_keys_feats_and_a_key_without_one_is_named(tmp_path, demo_wav):
    want = features()
    d = make_kaldi_dir(tmp_path / "d", KEYS, demo_wav)
    partial = {k: v for k, v in want.items() if k != "spk1-utt2"}
    write_features_dir(tmp_path / "f", {**partial, "stray-key": want[KEYS[0]]})
    (d / "feats.scp").write_text((tmp_path / "f/feats.scp").read_text())
    notes = []
    items = read_items({"path": str(d)}, notes=notes)
    assert [i.audio for i in items] == [str(demo_wav)] * 12 and "feats" not in items[6].fields
    assert any(re.match(rf"{d}/feats\.scp: 1 key\(s\) with no recording in wav\.scp, ignored: 'stray-key'", n)
               for n in notes), notes
    assert any(f"{d}/feats.scp: no line for 1 of 12 key(s), their 'feats' field unset: 'spk1-utt2'" in n
               for n in notes), notes
    dataset = KaldiDataset({"path": str(d), "name": "both"})
    assert np.array_equal(dataset.load_array("spk2-utt3", "feats"), want["spk2-utt3"])
    assert dataset.load_audio("spk2-utt3")[1] == 16000
    with pytest.raises(DataError, match=rf"datasets\.both: key 'spk1-utt2' \(.*wav\.scp:7\) has no line in "
                                        rf"{d}/feats\.scp"):
        dataset.load_array("spk1-utt2", "feats")


@pytest.mark.parametrize("damage, message", [
    ("missing_ark", r"feats\.scp:1: key 'spk0-utt0': its feature file \S+gone\.ark does not exist"),
    ("truncated_ark", r"key 'spk2-utt3' \(.*feats\.scp:12\): its feats\.scp entry '\S+:\d+' cannot be read: "),
    ("no_keys_file", r"not a Kaldi data dir \(no wav\.scp, no feats\.scp\)"),
    ("repeated_key", r"1 duplicate key\(s\): 'spk0-utt1' \(\S+feats\.scp:3, first at \S+feats\.scp:2\)"),
])
def test_bad_features_are_named_with_key_file_and_line(tmp_path, damage, message):
    d = write_features_dir(tmp_path / "d", features())
    scp = d / "feats.scp"
    if damage == "missing_ark":  # planning refuses it, as a missing audio file
        scp.write_text(scp.read_text().replace(str(d / "raw_fbank.1.ark"), str(d / "gone.ark")))
    elif damage == "truncated_ark":  # found when the key is read, in its shard
        ark = d / "raw_fbank.1.ark"
        ark.write_bytes(ark.read_bytes()[:-100])
        with pytest.raises(DataError, match=message):
            KaldiDataset({"path": str(d)}).load_array("spk2-utt3", "feats")
        return
    elif damage == "no_keys_file":
        scp.unlink()
    else:
        lines = scp.read_text().splitlines()
        scp.write_text("\n".join(lines[:2] + [lines[1]] + lines[2:]) + "\n")
    with pytest.raises(DataError, match=message):
        read_items({"path": str(d)})


def stats_of(frames: list[np.ndarray]) -> dict:
    allf = np.concatenate(frames).astype(np.float64)
    return {"count": len(allf), "sum": allf.sum(0), "sum_square": (allf ** 2).sum(0)}


def test_feature_statistics_over_a_kaldi_features_dir_and_a_rewritten_ark_reruns_its_shards(tmp_path):
    """collect-stats (frontend: upstream) over a dir of Kaldi features: the merged stats equal numpy's over the
    matrices; the ark rewritten in place with other values and the same offsets (a feature config changed, as
    make_fbank.sh rewrites it) makes every shard stale, naming feats.scp, and the rerun's stats are the new ones."""
    wd = copy_workflow(tmp_path / "wf")
    want = features(0)
    write_features_dir(wd / "data/kaldi_feats", want)
    config = read_config(wd)
    config["datasets"] = {"train": {"path": "data/kaldi_feats"}}
    config["stages"] = {"stats": {"runner": "snakeshard.stages.CollectStatsRunner",
                                  "provider": "snakeshard.stages.CollectStatsProvider",
                                  "provider_config": {"frontend": "upstream"}, "datasets": ["train"],
                                  "sharding": {"shard_seconds": 1.5, "keep_together": "spk"}}}
    write_config(wd, config)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    out = wd / "results/stats/train"
    assert [len((out / f"split.{n}/keys").read_text().split()) for n in range(3)] == [4, 4, 4]  # a speaker each
    with np.load(out / "feats_stats.npz") as got:
        ref = stats_of(list(want.values()))
        assert int(got["count"]) == ref["count"] == sum(map(len, want.values()))
        np.testing.assert_allclose(got["sum"], ref["sum"], rtol=1e-12)
        np.testing.assert_allclose(got["sum_square"], ref["sum_square"], rtol=1e-12)

    ark = wd / "data/kaldi_feats/raw_fbank.1.ark"
    scp_before = (wd / "data/kaldi_feats/feats.scp").read_text()
    new = features(1)
    write_features_dir(tmp_path / "again", new, ark=ark)  # the same ark path, shapes and offsets
    assert (tmp_path / "again/feats.scp").read_text() == scp_before
    os.utime(ark, ns=(ark.stat().st_atime_ns, ark.stat().st_mtime_ns + 10**9))  # a coarse clock would not see it
    os.utime(wd / "data/kaldi_feats/feats.scp")  # Kaldi writes its scp with its ark
    status = run_cli(wd, "status").stdout
    assert status.count("changed since it ran: its keys' lines in text, utt2spk or feats.scp") == 3, status
    rerun = run_snakemake(wd)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stderr.count("rule shard_stats:") + rerun.stderr.count("rule shards_stats:") >= 1
    with np.load(out / "feats_stats.npz") as got:
        np.testing.assert_allclose(got["sum"], stats_of(list(new.values()))["sum"], rtol=1e-12)


@pytest.fixture
def demo_wav() -> Path:
    from conftest import PROJECT

    return PROJECT / "data/demo/wav" / sorted(os.listdir(PROJECT / "data/demo/wav"))[0]
