"""Changed inputs under unchanged keys: exactly the shards they touch rerun, and nothing stale is read.

Real `snakemake` runs over a small Kaldi data dir of generated wavs, one key per shard, with a
runner whose results depend on the audio content, the segment times and the text, so a shard
that was wrongly kept shows up as a wrong merged line. Which shards ran is read from their
``done`` files (a rerun rewrites them; a kept shard's bytes stay the same).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import copy_workflow, read_config, run_cli, run_snakemake, write_config
import snakeshard
from snakeshard import load_dataset
from snakeshard.core.merge import StaleMergedOutput, require_current
from snakeshard.errors import SnakeshardError
from snakeshard.workflow.parse import read_fingerprints

AUDIO_MODULE = '''
from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard import load_dataset


class AudioProvider(EnvironmentProvider):
    def build_env_local(self):
        return {"dataset": load_dataset(self.config["dataset"]),
                "fail_on_keys": set(self.config.get("fail_on_keys", []))}


class AudioRunner(BaseRunner):
    """Per key: the number of samples, their absolute sum, and the key's text."""

    @staticmethod
    def forward(key, *, dataset, fail_on_keys):
        if key in fail_on_keys:
            raise RuntimeError(f"asked to fail on {key}")
        samples, rate = dataset.load_audio(key, dtype="int16")
        return {"samples": len(samples), "energy": int(abs(samples.astype("int64")).sum()),
                "ref": dataset[key].get("text", "-").replace(" ", "_")}
'''
KEYS = [f"k{i}" for i in range(6)]


def write_wav(path: Path, seed: int, seconds: float = 0.5) -> None:
    rng = np.random.default_rng(seed)
    sf.write(path, (rng.standard_normal(int(16000 * seconds)) * 3000).astype("int16"), 16000, subtype="PCM_16")


def make_audio_project(root: Path) -> Path:
    """A workflow copy with the audio runner over 6 keys (one per shard) in data/six."""
    wd = copy_workflow(root)
    (wd / "audio_stage.py").write_text(AUDIO_MODULE)
    data = wd / "data/six"
    (data / "wav").mkdir(parents=True)
    for i, key in enumerate(KEYS):
        write_wav(data / "wav" / f"{key}.wav", seed=i)
    (data / "wav.scp").write_text("".join(f"{k} data/six/wav/{k}.wav\n" for k in KEYS))
    (data / "text").write_text("".join(f"{k} words of {k}\n" for k in KEYS))
    write_config(wd, {
        "datasets": {"six": {"path": "data/six"}},
        "stages": {"energy": {"runner": "audio_stage.AudioRunner", "provider": "audio_stage.AudioProvider",
                              "datasets": ["six"], "sharding": {"shard_size": 1}}},
    })
    return wd


@pytest.fixture
def project(tmp_path: Path) -> Path:
    wd = make_audio_project(tmp_path / "wf")
    first = run_snakemake(wd)
    assert first.returncode == 0, first.stderr[-3000:]
    return wd


SET = "results/energy/six"


def dones(wd: Path) -> dict[int, bytes]:
    set_dir = wd / SET
    return {int(p.parent.name.split(".")[1]): p.read_bytes() for p in set_dir.glob("split.*/done")}


def rerun(wd: Path, *args: str) -> set[int]:
    """Run snakemake again; return the shards whose done it rewrote."""
    before = dones(wd)
    proc = run_snakemake(wd, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = dones(wd)
    return {n for n in after if before.get(n) != after[n]}


def expected_merged(wd: Path) -> dict[str, bytes]:
    """The merged files a clean in-process run over the current data produces."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("audio_stage_copy", wd / "audio_stage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cwd = os.getcwd()
    os.chdir(wd)  # relative audio paths, as in a shard job
    try:
        dataset = load_dataset({"path": "data/six"})
        results = [module.AudioRunner.forward(k, dataset=dataset, fail_on_keys=set()) for k in dataset.keys]
    finally:
        os.chdir(cwd)
    return {field: "".join(f"{r_key} {r[field]}\n" for r_key, r in zip(dataset.keys, results)).encode()
            for field in ("samples", "energy", "ref")}


def merged(wd: Path) -> dict[str, bytes]:
    return {field: (wd / SET / field).read_bytes() for field in ("samples", "energy", "ref")}


def status(wd: Path) -> str:
    proc = run_cli(wd, "status")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_audio_rewritten_in_place_reruns_only_its_shard(project):
    """New content at the same path for k3: status says stale (audio), exactly shard 3 reruns, merged
    output equals a clean run on the new data. Before: `Nothing to be done` and the old merged text."""
    old = merged(project)
    write_wav(project / "data/six/wav/k3.wav", seed=99)
    out = status(project)
    assert "split.3     stale" in out and "its audio files (size or mtime)" in out
    assert "merged: stale" in out
    assert rerun(project) == {3}
    assert merged(project) == expected_merged(project) != old
    assert "merged: yes, current" in status(project)


def test_clean_run_on_the_changed_data_gives_the_same_bytes(project, tmp_path):
    """After in-place audio edits and a rerun, the merged files equal those of a fresh project run on the new data."""
    write_wav(project / "data/six/wav/k1.wav", seed=41)
    write_wav(project / "data/six/wav/k4.wav", seed=44, seconds=0.7)
    assert rerun(project) == {1, 4}
    fresh = make_audio_project(tmp_path / "fresh")
    for key in ("k1", "k4"):
        shutil.copyfile(project / f"data/six/wav/{key}.wav", fresh / f"data/six/wav/{key}.wav")
    assert run_snakemake(fresh).returncode == 0
    assert merged(project) == merged(fresh)


def test_key_repointed_in_wav_scp_reruns_only_its_shard(project):
    """k2 now points at k5's file: the plan is redone, shard 2's fingerprint changes (its wav.scp record), only it reruns."""
    scp = project / "data/six/wav.scp"
    scp.write_text(scp.read_text().replace("data/six/wav/k2.wav", "data/six/wav/k5.wav"))
    # the record files there that count (all by default), and the audio: k5.wav is another file
    assert "changed since it ran: its keys' lines in wav.scp or text, its audio files (size or mtime)\n" in status(project)
    assert rerun(project) == {2}
    assert merged(project) == expected_merged(project)


def test_key_switched_to_a_pipe_reruns_only_its_shard(project):
    """k4's wav.scp value becomes a Kaldi pipe reading another file: only shard 4 reruns, with the pipe's audio."""
    scp = project / "data/six/wav.scp"
    scp.write_text(scp.read_text().replace("k4 data/six/wav/k4.wav", "k4 cat data/six/wav/k0.wav |"))
    assert rerun(project) == {4}
    lines = merged(project)["energy"].decode().splitlines()
    assert lines[4].split()[1] == lines[0].split()[1]  # k4 now has k0's audio
    assert merged(project) == expected_merged(project)


def test_segments_added_then_one_time_changed_reruns_only_that_shard(project):
    """A switch to segments (same utterance keys cut from the recordings) reruns every shard; then one
    changed segment end reruns only its shard."""
    seg = project / "data/six/segments"
    seg.write_text("".join(f"{k} {k} 0.0 0.25\n" for k in KEYS))
    assert rerun(project) == set(range(6))
    assert merged(project)["samples"] == b"".join(f"{k} 4000\n".encode() for k in KEYS)
    seg.write_text(seg.read_text().replace("k5 k5 0.0 0.25", "k5 k5 0.0 0.3"))
    assert rerun(project) == {5}
    assert merged(project) == expected_merged(project)


def test_text_edit_reruns_its_shard_unless_the_stage_leaves_text_out(project):
    """The dataset's text is a per-key record the stage can read: editing k1's reruns shard 1. A stage whose
    `fingerprint.records` leaves text out (e.g. ASR, which never reads it) reruns nothing for a text edit."""
    text = project / "data/six/text"
    text.write_text(text.read_text().replace("k1 words of k1", "k1 other words"))
    assert rerun(project) == {1}
    assert b"k1 other_words\n" in merged(project)["ref"]

    config = read_config(project)
    config["stages"]["energy"]["fingerprint"] = {"records": ["wav.scp", "segments"]}
    write_config(project, config)
    assert rerun(project) == set(range(6))  # the fingerprint's make-up changed: every shard once
    text.write_text(text.read_text().replace("k2 words of k2", "k2 changed"))
    assert rerun(project) == set()


def test_a_json_lines_key_repointed_reruns_its_shard_when_only_the_audio_records_count(tmp_path):
    """The shipped stages count only wav.scp and segments (they read the audio alone). Over a JSON Lines manifest
    that selection counts the whole record, whose audio path is in it: repointing k2's audio reruns shard 2, even
    with the audio identity off, and the merged line is the new audio's. (It counted nothing there before
    2026-11-26: the shard kept the old audio's result and status said current.)"""
    import json

    wd = make_audio_project(tmp_path / "wf")
    manifest = wd / "data/six.jsonl"
    manifest.write_text("".join(json.dumps({"key": k, "audio": f"data/six/wav/{k}.wav", "text": f"words of {k}"})
                                + "\n" for k in KEYS))
    config = read_config(wd)
    config["datasets"] = {"six": {"path": "data/six.jsonl", "format": "jsonl"}}
    config["stages"]["energy"]["fingerprint"] = {"records": ["wav.scp", "segments"], "audio": False}
    write_config(wd, config)
    assert run_snakemake(wd).returncode == 0
    energy = dict(line.split() for line in (wd / SET / "energy").read_text().splitlines())
    manifest.write_text(manifest.read_text().replace("data/six/wav/k2.wav", "data/six/wav/k4.wav"))
    assert "changed since it ran: its keys' lines in jsonl\n" in status(wd)  # the stage counts only the audio's
    assert rerun(wd) == {2}
    after = dict(line.split() for line in (wd / SET / "energy").read_text().splitlines())
    assert after == {**energy, "k2": energy["k4"]}


def test_a_sharding_change_is_told_as_a_new_cut_not_as_changed_audio(project):
    """Shards of 1 key become shards of 2: each shard holds other keys, and with them other records and audio
    files; status names the cause, the new cut, and not audio or records that did not change."""
    import re

    config = read_config(project)
    config["stages"]["energy"]["sharding"] = {"shard_size": 2}
    write_config(project, config)
    out = status(project)
    for n in range(3):
        assert re.search(rf"split\.{n} +stale +2 items +changed since it ran: its keys \(the plan was cut anew\)\n",
                         out), out
    assert "audio files" not in out and "records" not in out, out


def test_a_plan_of_fewer_shards_removes_the_old_shard_dirs_after_its_merge(project):
    """Six shards of 1 key become three of 2: after the merge, split.3..5 and their logs (nothing reads them any
    more) are gone, the merge log says so, and the merged output is the same as before. A split dir the user
    moved elsewhere and linked: the link goes, the directory it points to stays."""
    before = merged(project)
    (project / SET / "split.5").rename(project / "scratch-split.5")
    (project / SET / "split.5").symlink_to(project / "scratch-split.5")
    config = read_config(project)
    config["stages"]["energy"]["sharding"] = {"shard_size": 2}
    write_config(project, config)
    assert rerun(project) == {0, 1, 2}
    assert sorted(p.name for p in (project / SET).glob("split.*")) == ["split.0", "split.1", "split.2"]
    assert sorted(p.name for p in (project / SET / "logs").glob("split.*")) == [f"split.{n}.log" for n in range(3)]
    assert ("removed split.3..split.5 (3 directories an earlier plan of more shards left): the plan has 3 shards"
            in (project / SET / "logs/merge.log").read_text())
    assert (project / "scratch-split.5/done").is_file()
    assert merged(project) == before


def test_audio_identity_opt_out_skips_the_stat(project):
    """`fingerprint.audio: false` (huge sets on slow filesystems): after the switch, an in-place audio edit
    reruns nothing, as documented; the fingerprints record no audio identity."""
    config = read_config(project)
    config["stages"]["energy"]["fingerprint"] = {"audio": False}
    write_config(project, config)
    assert rerun(project) == set(range(6))
    assert {e["audio"] for e in read_fingerprints(project / SET)["shards"]} == {""}
    write_wav(project / "data/six/wav/k3.wav", seed=77)
    assert rerun(project) == set()


def test_editing_forward_reruns_the_stage_a_comment_does_not_and_code_false_opts_out(project):
    """The runner's module source is part of the stage fingerprint (parsed: comments do not count)."""
    module = project / "audio_stage.py"
    module.write_text(module.read_text() + "\n# a comment only\n")
    assert rerun(project) == set()
    module.write_text(module.read_text().replace('"samples": len(samples)', '"samples": len(samples) + 1'))
    assert rerun(project) == set(range(6))
    assert merged(project)["samples"].startswith(b"k0 8001\n")

    config = read_config(project)
    config["stages"]["energy"]["fingerprint"] = {"code": False}
    write_config(project, config)
    assert rerun(project) == set(range(6))  # leaving the code out changes the fingerprint once
    module.write_text(module.read_text().replace("len(samples) + 1", "len(samples) + 2"))
    assert rerun(project) == set()


def test_wer_refuses_a_merge_whose_audio_changed_after_the_run(project):
    """One recording rewritten after the run, no snakemake since: `snakeshard wer` refuses the merge as stale, as
    `snakeshard status` calls it (it scored it from the last parse's fingerprints.json: a user trial)."""
    (project / "ref.txt").write_text("".join(f"{k} x\n" for k in KEYS))
    assert run_cli(project, "wer", "--hyp", f"{SET}/ref", "--ref", "ref.txt").returncode == 0
    write_wav(project / "data/six/wav/k3.wav", seed=33)
    wer = run_cli(project, "wer", "--hyp", f"{SET}/ref", "--ref", "ref.txt")
    assert wer.returncode == 1 and "WER" not in wer.stdout
    assert f"{SET}: the merged output is stale" in wer.stderr and "Traceback" not in wer.stderr
    assert "merged: stale" in status(project)
    assert rerun(project) == {3}
    assert run_cli(project, "wer", "--hyp", f"{SET}/ref", "--ref", "ref.txt").returncode == 0


def test_failed_rerun_leaves_merged_output_stale_and_refused(project):
    """A data change whose rerun fails in one shard: the old merged files stay on disk, but status says
    `merged: stale`, require_current refuses them, and `snakeshard wer` refuses to score them."""
    config = read_config(project)
    config["stages"]["energy"]["provider_config"] = {"fail_on_keys": ["k6"]}
    config["stages"]["energy"]["fingerprint_ignore"] = ["fail_on_keys"]
    write_config(project, config)
    write_wav(project / "data/six/wav/k6.wav", seed=6)
    with open(project / "data/six/wav.scp", "a") as f:
        f.write("k6 data/six/wav/k6.wav\n")
    proc = run_snakemake(project)
    assert proc.returncode != 0
    out = status(project)
    assert "split.6     failed" in out
    assert "merged: stale" in out and "summary: 6 done, 1 failed" in out
    assert (project / SET / "merged.json").is_file()  # the old one, from 6 keys
    current = read_fingerprints(project / SET)["inputs"]
    with pytest.raises(StaleMergedOutput, match="the merged output is stale"):
        require_current(project / SET, current)
    with pytest.raises(StaleMergedOutput, match="the merged output is stale"):  # the public form: the last parse's
        snakeshard.require_current(project / SET)
    with pytest.raises(StaleMergedOutput, match=r"results: no fingerprints\.json .*not a stage's set"):
        snakeshard.require_current(project / "results")
    (project / "ref.txt").write_text("".join(f"{k} x\n" for k in KEYS))
    wer = run_cli(project, "wer", "--hyp", f"{SET}/ref", "--ref", "ref.txt")
    assert wer.returncode == 1 and "the merged output is stale" in wer.stderr

    config["stages"]["energy"]["provider_config"] = {}
    write_config(project, config)
    assert rerun(project) == {6}
    assert "merged: yes, current" in status(project)
    assert isinstance(require_current(project / SET, read_fingerprints(project / SET)["inputs"]), dict)
    assert snakeshard.require_current(project / SET)["inputs"] == read_fingerprints(project / SET)["inputs"]


def test_appending_keys_runs_only_the_new_and_last_shards(tmp_path):
    """With shard_size (and shard_seconds, which the shipped configs use), appending keys keeps every
    full shard: 60 keys in shards of 10, then 5 more -> only a new shard 6 runs."""
    wd = make_audio_project(tmp_path / "wf")
    lines = [f"a{i:02d} data/six/wav/k{i % 6}.wav\n" for i in range(65)]
    (wd / "data/six/wav.scp").write_text("".join(lines[:60]))
    (wd / "data/six/text").unlink()
    config = read_config(wd)
    config["stages"]["energy"]["sharding"] = {"shard_size": 10}
    write_config(wd, config)
    assert run_snakemake(wd).returncode == 0
    (wd / "data/six/wav.scp").write_text("".join(lines))
    assert rerun(wd) == {6}

    # shard_seconds: the last partial shard grows or a new one starts; full shards stay
    config["stages"]["energy"]["sharding"] = {"shard_seconds": 5.0}  # 10 keys of 0.5 s per shard
    write_config(wd, config)
    shutil.rmtree(wd / "results")  # (a shard with the same keys, records and audio would be reused, rightly)
    (wd / "data/six/wav.scp").write_text("".join(lines[:55]))
    assert run_snakemake(wd).returncode == 0
    (wd / "data/six/wav.scp").write_text("".join(lines))
    assert rerun(wd) == {5, 6}  # shard 5 held 5 keys and takes 5 more; 6 is new


def test_removing_a_key_reruns_its_shard_and_the_shards_after_it(tmp_path):
    """What docs/failures-and-reruns.md says of a line deleted from wav.scp (a bad utterance taken out): with
    shard_size, the shards before it stay; its shard and every later one hold other keys now, and rerun."""
    wd = make_audio_project(tmp_path / "wf")
    lines = [f"a{i:02d} data/six/wav/k{i % 6}.wav\n" for i in range(60)]
    (wd / "data/six/wav.scp").write_text("".join(lines))
    (wd / "data/six/text").unlink()
    config = read_config(wd)
    config["stages"]["energy"]["sharding"] = {"shard_size": 10}
    write_config(wd, config)
    assert run_snakemake(wd).returncode == 0
    (wd / "data/six/wav.scp").write_text("".join(lines[:25] + lines[26:]))  # a25, in shard 2, taken out
    assert rerun(wd) == {2, 3, 4, 5}


def test_shipped_configs_shard_stably():
    """The demo config and the project template use sharding that keeps shards when keys are appended."""
    from conftest import PROJECT

    import yaml

    demo = yaml.safe_load((PROJECT / "config/config.yaml").read_text())
    assert set(demo["stages"]["asr"]["sharding"]) == {"shard_seconds"}
    template = (PROJECT / "src/snakeshard/project_template/config.yaml").read_text()
    assert "num_shards" not in template.split("sharding:")[1].split("\n")[0]


def test_require_current_without_merge_names_the_dir(tmp_path):
    with pytest.raises(SnakeshardError, match="is not merged"):
        require_current(tmp_path, "x")


def test_a_slurm_jobs_parse_reuses_the_main_processs_audio_identity(project, monkeypatch):
    """Workflow(reuse_audio_identity=True), what a job's own Snakemake builds: it takes the audio digests from
    fingerprints.json instead of stat'ing every file again, so it agrees with the main process even if a
    file changed since; a fresh main-process parse sees the change."""
    from snakeshard.workflow.parse import Workflow

    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))  # audio_stage.py, as the Snakefile's parse sees it
    config = read_config(project)
    written = read_fingerprints(SET)["shards"]
    write_wav(project / "data/six/wav/k2.wav", seed=123)
    reused = Workflow(config, reuse_audio_identity=True).shard_inputs["energy", "six"]
    assert [e["audio"] for e in reused] == [e["audio"] for e in written]
    fresh = Workflow(config).shard_inputs["energy", "six"]
    assert [n for n, (a, b) in enumerate(zip(fresh, written)) if a["audio"] != b["audio"]] == [2]


def test_merge_refuses_when_the_plan_changed_under_the_run(project):
    """The merge job is given the inputs digest its DAG was built with; fingerprints.json rewritten by another
    parse since (other data or config) makes it refuse rather than merge shards of another plan."""
    proc = run_cli(project, "merge", "--spec", f"{SET}/spec.json", "--set-dir", SET, "--inputs", "0" * 20)
    assert proc.returncode == 1
    assert "refusing to merge results/energy/six: its plan changed while this run was going" in proc.stderr


def test_audio_file_removed_behind_an_unchanged_wav_scp_fails_the_parse_naming_it(project):
    """The plan is cached (wav.scp unchanged), but the identity check at parse finds the file gone."""
    (project / "data/six/wav/k4.wav").unlink()
    proc = run_snakemake(project, "-n")
    assert proc.returncode != 0
    assert ("audio file data/six/wav/k4.wav of key 'k4' (data/six/wav.scp:5) no longer exists (shard 4, "
            "results/energy/six/split.4); it is still listed in the dataset") in proc.stdout + proc.stderr


def test_a_merged_file_deleted_after_the_merge_is_refused_then_merged_again(project):
    """A merged file gone while merged.json still lists it: status says so, require_current and `snakeshard wer`
    refuse the set naming the file and the fix, and the next snakemake run merges it again from its shards
    (no shard reruns)."""
    (project / SET / "energy").unlink()
    assert "merged: missing energy" in status(project)
    with pytest.raises(StaleMergedOutput,
                       match=r"merged file\(s\) energy missing .*; run snakemake again: it merges .* again from its shards"):
        require_current(project / SET, read_fingerprints(project / SET)["inputs"])
    (project / "ref.txt").write_text("".join(f"{k} x\n" for k in KEYS))
    wer = run_cli(project, "wer", "--hyp", f"{SET}/ref", "--ref", "ref.txt")
    assert wer.returncode == 1 and "energy missing" in wer.stderr and "Traceback" not in wer.stderr
    assert rerun(project) == set()
    assert merged(project) == expected_merged(project)
    assert "merged: yes, current" in status(project)


def test_the_code_fingerprint_follows_the_projects_own_imports_and_no_installed_package(tmp_path, monkeypatch):
    """Which modules a runner's code digest covers (the real run: test_first_contact's edit of an imported module):
    the project's files its module imports, at the top or in a function, by `import a.b`, `from a import b` (b a
    module) or `from a.b import Name`, through packages with or without __init__.py, and what those import in
    turn; not an installed package (numpy), snakeshard, or a package in a venv kept inside the project."""
    from snakeshard.core.user_source import project_modules

    files = {"run.py": "import numpy\nimport snakeshard\nfrom models import gru\nfrom models.cnn import Net\n"
                       "import vendored\n\ndef build():\n    from helpers import x\n",
             "models/gru.py": "y = 1\n", "models/cnn.py": "import deep.inner\nclass Net: pass\n",
             "deep/__init__.py": "", "deep/inner.py": "from . import sibling\n", "deep/sibling.py": "",
             "helpers.py": "x = 1\n", ".venv/lib/python3.11/site-packages/vendored.py": "v = 1\n",
             "unused.py": "u = 1\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / ".venv/lib/python3.11/site-packages"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert sorted(project_modules(str(tmp_path / "run.py"), "stages.s.runner")) == [
        "deep/__init__.py", "deep/inner.py", "deep/sibling.py", "helpers.py", "models/cnn.py", "models/gru.py"]
