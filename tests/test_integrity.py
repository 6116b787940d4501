"""Nothing looks complete while it is wrong: values that would split their line, hooks that return nothing,
names the shard dir needs, arrays of another shape, a set read after a failed merge or from a moved project,
a driver killed mid-canary, temp files of a killed merge, keys no file or terminal can carry.

Each case is a real `snakemake` run where a run is involved, and says what happens to the bad input.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile

from conftest import (TOY_MODULE, copy_workflow, make_kaldi_dir, read_config, run_cli, run_snakemake, wait_for,
                      write_config)
from snakeshard.errors import MergeError, ShardError

# Every character str.splitlines() splits on.
LINE_BREAKS = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
KEYS = [f"utt{i:03d}" for i in range(40)]
WAV = "data/demo/wav/cards-001.wav"

MODULE = '''
import numpy as np

from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard import load_dataset


class Provider(EnvironmentProvider):
    def build_env_local(self):
        return {"dataset": load_dataset(self.config["dataset"]), "values": self.config.get("values", {}),
                "field": self.config.get("field", "text"), "widths": self.config.get("widths", {})}


class ValueRunner(BaseRunner):
    """Per key its value from provider_config.values (default: the key upper-cased), as a text field
    ``text`` or a JSON Lines field ``record`` ({"v": value})."""

    @staticmethod
    def forward(keys, *, dataset, values, field, widths):
        batch = keys if isinstance(keys, list) else [keys]
        out = [{"text": values.get(k, k.upper())} if field == "text" else {"record": {"v": values.get(k, k)}}
               for k in batch]
        return out if isinstance(keys, list) else out[0]

    @staticmethod
    def item_length(key, **env):
        return float(key[3:])  # later keys longer: sort_by_length runs each shard's keys backwards


class NoneClosingRunner(ValueRunner):
    """ESPnet3's close_writers: closes its writers, returns nothing."""

    @staticmethod
    def close_writers(writers, state, **env):
        writers.close()


class OwnWritersRunner(ValueRunner):
    """Writes its own 'key value' file, and its close_writers returns nothing."""

    @staticmethod
    def open_writers(shard_dir, **env):
        return open(shard_dir / "text", "w")

    @staticmethod
    def write_record(writers, result, state, **env):
        writers.write(f"{result['key']} {result['text']}\\n")

    @staticmethod
    def close_writers(writers, state, **env):
        writers.close()


class ItemsStateRunner(ValueRunner):
    """Writes its state to items.json, the shard's plan slice."""

    @staticmethod
    def finalize_state(state, shard_dir, **env):
        (shard_dir / "items.json").write_text("{}")
        return ["items.json"]


class ArrayRunner(ValueRunner):
    """feats: a (2, width) matrix per key of its value (provider_config.values, default its number), width from
    provider_config.widths (default 3), and its text."""

    @staticmethod
    def forward(key, *, dataset, values, field, widths):
        return {"feats": np.full((2, widths.get(key, 3)), values.get(key, int(key[3:])), np.float32), "text": key}


class DictMergeRunner(ValueRunner):
    """ESPnet3's merge: writes its file, returns {}."""

    @classmethod
    def merge(cls, shard_dirs, output_dir):
        super().merge(shard_dirs, output_dir)
        return {}


class UnwrittenMergeRunner(ValueRunner):
    """A merge that names a file it did not write."""

    @classmethod
    def merge(cls, shard_dirs, output_dir):
        return [*super().merge(shard_dirs, output_dir), "summary.txt"]
'''


def project(root: Path, runner: str = "ValueRunner", keys=KEYS, shards: int = 10, **stage) -> Path:
    wd = copy_workflow(root)
    (wd / "integ.py").write_text(MODULE)
    (wd / "toy.py").write_text(TOY_MODULE)
    make_kaldi_dir(wd / "data/toy", keys, Path(WAV))
    config = {"output_dir": "results", "datasets": {"toy": {"path": "data/toy", "format": "kaldi"}},
              "stages": {"s": {"runner": f"integ.{runner}", "provider": "integ.Provider", "provider_config": {},
                               "datasets": ["toy"], "sharding": {"num_shards": shards}, **stage}}}
    write_config(wd, config)
    return wd


def set_provider_config(wd: Path, stage: str = "s", **values) -> None:
    config = read_config(wd)
    config["stages"][stage]["provider_config"].update(values)
    write_config(wd, config)


# How a shard's keys reach the writers: in plan order one by one (the bulk text path), in sorted batches
# (longest first: out of plan order), and from two pool workers in completion order.
ORDERINGS = {"plain": {}, "sorted_batches": {"batch_size": 4, "sort_by_length": True},
             "unordered_pool": {"workers": 2, "worker_order": "unordered"}}
BROKEN = {f"utt{4 * n + 1:03d}": f"a{brk}b" for n, brk in enumerate(LINE_BREAKS)}  # one per shard of 4 keys


@pytest.mark.parametrize("ordering", ORDERINGS)
def test_a_text_value_holding_any_line_break_fails_its_shard_naming_key_and_field(tmp_path, ordering):
    """Each of the 10 shards has one key whose text value holds one of the 10 line breaks: every shard
    fails naming its key, the field and the break; nothing is merged (before: only \\n was refused, and a
    shard whose keys were written out of plan order merged a keyless line and lost a key, rc 0)."""
    wd = project(tmp_path / "wf", canary=0, **ORDERINGS[ordering])  # each shard's own failure (a canary would stop
    set_provider_config(wd, values=BROKEN)                          # the stage at utt001, in its first 2 keys)
    run = run_snakemake(wd)
    assert run.returncode != 0
    for n, (key, value) in enumerate(BROKEN.items()):
        log = (wd / f"results/s/toy/logs/split.{n}.log").read_text()
        assert f"item {key!r}: field 'text' holds a line break ({LINE_BREAKS[n]!r})" in log, log[-2000:]
        assert not (wd / f"results/s/toy/split.{n}/done").exists()
    assert not (wd / "results/s/toy/merged.json").exists()


@pytest.mark.parametrize("ordering", ORDERINGS)
def test_json_lines_keep_every_line_break_in_one_line_per_key(tmp_path, ordering):
    """The same values in a JSON Lines field: merged, one line per key whatever splits it (\\n alone or
    str.splitlines: \\x85, \\u2028, \\u2029 are escaped, JSON escapes the rest), each value back as written."""
    wd = project(tmp_path / "wf", **ORDERINGS[ordering])
    set_provider_config(wd, values=BROKEN, field="record")
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (wd / "results/s/toy/record.jsonl").read_bytes().decode("utf-8")
    assert len(text.splitlines()) == len(text.split("\n")) - 1 == len(KEYS)
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["key"] for r in records] == KEYS
    assert [r["value"]["v"] for r in records] == [BROKEN.get(k, k) for k in KEYS]


def test_close_writers_returning_none_still_merges_the_default_writers_fields(tmp_path):
    """ESPnet3's close_writers closes and returns None: the default writers' index files are found, so the
    merge holds every key (before: merged.json listed only fields.json and status said current)."""
    wd = project(tmp_path / "wf", runner="NoneClosingRunner", shards=2)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (wd / "results/s/toy/text").read_text() == "".join(f"{k} {k.upper()}\n" for k in KEYS)
    assert "text" in json.loads((wd / "results/s/toy/merged.json").read_text())["files"]


def test_own_writers_whose_close_writers_returns_none_fail_naming_hook_and_files(tmp_path):
    """Writers of the runner's own that wrote a per-key file, and a close_writers returning None: the stage's
    canary (on by default) fails naming runner, hook and file, no shard job starts, nothing is merged; with the
    canary off, each shard fails so."""
    wd = project(tmp_path / "wf", runner="OwnWritersRunner", shards=2)
    run = run_snakemake(wd)
    assert run.returncode != 0
    log = (wd / "results/s/logs/canary.log").read_text()
    assert "integ.OwnWritersRunner.close_writers returned None, but its writers wrote ['text'] into" in log, log
    assert not (wd / "results/s/toy/logs").exists()
    config = read_config(wd)
    config["stages"]["s"]["canary"] = 0
    write_config(wd, config)
    assert run_snakemake(wd).returncode != 0
    log = (wd / "results/s/toy/logs/split.0.log").read_text()
    assert "integ.OwnWritersRunner.close_writers returned None, but its writers wrote ['text'] into" in log, log
    assert not (wd / "results/s/toy/merged.json").exists()


def test_a_rerun_removes_the_merged_files_first_so_a_failed_one_leaves_no_scp_into_rewritten_shards(tmp_path):
    """Merged scp files point into the shards' arks, which a rerun rewrites (or, failing, leaves half written),
    and kaldiio reads them without asking merged.json: a rerun's first shard job removes the set's merged files,
    summary and merged.json. After a failed rerun the set has none (before: the old feats.scp read 33 keys' new
    values, 4 of a failed shard's partial ark, and 6 deleted files: a user trial); shards that succeeded keep
    their done, and the fixed rerun merges the new values."""
    wd = project(tmp_path / "wf", runner="ArrayRunner", shards=4, canary=0)
    set_dir = wd / "results/s/toy"
    assert run_snakemake(wd).returncode == 0
    merged = ["feats.scp", "fields.json", "merged.json", "summary.html", "text"]
    assert json.loads((set_dir / "merged.json").read_text())["files"] == ["feats.scp", "text", "fields.json"]
    assert all((set_dir / name).exists() for name in merged)
    set_provider_config(wd, values={"utt000": 100, "utt015": "bad"})  # every shard reruns; shard 1 fails at utt015
    failed = run_snakemake(wd)
    assert failed.returncode != 0
    assert "utt015" in (set_dir / "logs/split.1.log").read_text()
    assert [name for name in merged if (set_dir / name).exists()] == []
    assert [(set_dir / f"split.{n}/done").exists() for n in range(4)] == [True, False, True, True]
    set_provider_config(wd, values={"utt000": 100})
    fixed = run_snakemake(wd)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    feats = dict(kaldiio.load_scp_sequential(str(set_dir / "feats.scp")))
    assert list(feats) == KEYS and feats["utt000"][0, 0] == 100 and feats["utt015"][0, 0] == 15
    assert all((set_dir / name).exists() for name in merged)


@pytest.mark.parametrize("runner, error", [
    ("DictMergeRunner", "integ.DictMergeRunner.merge returned {}: it returns the list of the names of the files it "
                        "wrote in "),
    ("UnwrittenMergeRunner", "integ.UnwrittenMergeRunner.merge returned ['summary.txt'], which "),
])
def test_a_merge_that_returns_no_list_of_its_files_fails_naming_the_hook(tmp_path, runner, error):
    """ESPnet3's merge returns {}: merged.json listed no file, and a merged file removed afterwards went unseen
    (status said current, snakemake -n nothing to do: a user trial). A returned name that the set dir does not
    hold is refused too. The merge fails, so nothing is recorded as merged; every shard keeps its done."""
    wd = project(tmp_path / "wf", runner=runner, shards=2)
    run = run_snakemake(wd)
    assert run.returncode != 0
    log = (wd / "results/s/toy/logs/merge.log").read_text()
    assert error in log, log[-2000:]
    assert not (wd / "results/s/toy/merged.json").exists()
    assert all((wd / f"results/s/toy/split.{n}/done").exists() for n in range(2))


def test_names_the_shard_dir_uses_are_refused_and_a_rerun_recovers(tmp_path):
    """A field named items.json (or jobs, keys, done) is refused at parse when configured, at its first write
    otherwise; a finalize_state that wrote items.json fails naming it, and once fixed the rerun works (the
    plan's slice is written again; before: every later rerun failed with a bare JSONDecodeError)."""
    from test_typed_outputs import run_table

    for name in ("items.json", "jobs", "keys", "done"):
        with pytest.raises(ShardError, match=rf"item 'k0': result field '{name}' cannot be used as a file name"):
            run_table(tmp_path / name, {"k0": {name: 1}})
    wd = project(tmp_path / "wf", runner="ItemsStateRunner", shards=2, outputs={"items.json": {"format": "text"}})
    dry = run_snakemake(wd, "-n")
    assert dry.returncode != 0 and "stages.s.outputs.items.json: 'items.json' cannot be a result field's file name" \
        in dry.stdout + dry.stderr
    config = read_config(wd)
    del config["stages"]["s"]["outputs"]
    write_config(wd, config)
    run = run_snakemake(wd)
    assert run.returncode != 0
    assert "finalize_state wrote 'items.json', a name the plan and the shard job use" in \
        (wd / "results/s/logs/canary.log").read_text()  # the stage's canary (on by default): no shard job ran
    config["stages"]["s"]["runner"] = "integ.ValueRunner"
    write_config(wd, config)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (wd / "results/s/toy/text").read_text() == "".join(f"{k} {k.upper()}\n" for k in KEYS)


def test_an_array_field_keeps_one_trailing_shape_in_a_shard_and_across_shards(tmp_path):
    """(3, 80) then (3, 40), or a vector then a matrix, in one ark field: the second key fails naming both
    shapes. Shards that disagree (each alike inside) are refused by the merge naming the field. (An npy field
    takes arrays of any shape: it is the format for them.)"""
    from snakeshard.core.merge import merge_fragments
    from test_typed_outputs import run_table

    wide, narrow = np.zeros((3, 80), np.float32), np.zeros((3, 40), np.float32)
    with pytest.raises(ShardError, match=r"item 'k1': field 'f' is an array of shape \(3, 40\), but earlier "
                                         r"keys gave it shape \(N, 80\)"):
        run_table(tmp_path / "ark", {"k0": {"f": wide}, "k1": {"f": narrow}})
    run_table(tmp_path / "npy", {"k0": {"f": wide}, "k1": {"f": narrow}}, outputs={"f": {"format": "npy"}})
    with pytest.raises(ShardError, match=r"item 'k1': field 'f' is an array of shape \(3, 80\), but earlier keys "
                                         r"gave it shape \(N,\)"):
        run_table(tmp_path / "dims", {"k0": {"f": np.zeros(3, np.float32)}, "k1": {"f": wide}})
    # zero frames of the field's width are still that shape (an empty utterance of a generic array field)
    done = run_table(tmp_path / "empty", {"k0": {"f": wide}, "k1": {"f": np.zeros((0, 80), np.float32)}})
    assert done["fields"]["f"]["shape"] == [None, 80]
    shards = [tmp_path / "a/split.0", tmp_path / "b/split.0"]
    run_table(tmp_path / "a", {"k0": {"f": wide}})
    run_table(tmp_path / "b", {"k1": {"f": narrow}})
    with pytest.raises(MergeError, match=r"field 'f' is .*'shape': \[None, 40\].* but .*'shape': \[None, 80\]"):
        merge_fragments(shards, tmp_path / "merged")


def test_fbank_refuses_a_recording_shorter_than_a_frame_and_a_stereo_one_naming_key_and_file(tmp_path):
    """fbank over three keys in three shards: a real utterance is done; 5 samples (no 25 ms frame) fail
    naming the key and the sample count (before: a (0, 80) matrix, utt2num_frames 0); a stereo file fails
    naming key, file and channels (before: the library's error, naming a batch)."""
    wd = copy_workflow(tmp_path / "wf")
    wav = wd / "data/odd"
    wav.mkdir(parents=True)
    soundfile.write(wav / "short.wav", np.zeros(5, np.int16), 16000)
    soundfile.write(wav / "stereo.wav", np.zeros((16000, 2), np.int16), 16000)
    (wav / "wav.scp").write_text(f"a_real {wd / WAV}\nb_short data/odd/short.wav\nc_stereo data/odd/stereo.wav\n")
    config = read_config(wd)
    config["datasets"] = {"odd": {"path": "data/odd"}}
    config["stages"] = {"fbank": {**config["stages"]["fbank"], "datasets": ["odd"], "sharding": {"shard_size": 1}}}
    write_config(wd, config)
    run = run_snakemake(wd)
    assert run.returncode != 0
    logs = wd / "results/fbank/odd/logs"
    assert (wd / "results/fbank/odd/split.0/done").exists()
    assert "key 'b_short': 5 samples (0.3 ms) are shorter than one 25 ms frame: no fbank frames" in \
        (logs / "split.1.log").read_text()
    assert "key 'c_stereo' (data/odd/wav.scp:3): data/odd/stereo.wav has 2 channels, and this stage reads one" in \
        (logs / "split.2.log").read_text()


def toy_project(root: Path, keys=KEYS, **config_changes) -> Path:
    """conftest's toy workflow (toy.UpperRunner, 40 keys, 4 shards)."""
    wd = copy_workflow(root)
    (wd / "toy.py").write_text(TOY_MODULE)
    make_kaldi_dir(wd / "data/toy", keys, Path(WAV))
    write_config(wd, {"output_dir": "results", "datasets": {"toy": {"path": "data/toy", "format": "kaldi"}},
                      "stages": {"upper": {"runner": "toy.UpperRunner", "provider": "toy.ToyProvider",
                                           "provider_config": {}, "datasets": ["toy"],
                                           "sharding": {"num_shards": 4}}}, **config_changes})
    return wd


def test_wer_refuses_a_set_whose_merge_failed(tmp_path):
    """After a merge that failed (a fragment changed since its shard wrote it), `snakeshard wer` over the old
    merged text refuses naming the set (before: it printed the old WER with rc 0 once merged.json was gone)."""
    wd = toy_project(tmp_path / "wf")
    assert run_snakemake(wd).returncode == 0
    (wd / "data/ref").write_text("".join(f"{k} {k.upper()}\n" for k in KEYS))
    ok = run_cli(wd, "wer", "--hyp", "results/upper/toy/text", "--ref", "data/ref")
    assert ok.returncode == 0 and ok.stdout.startswith("WER 0.00%"), ok.stdout + ok.stderr
    with open(wd / "results/upper/toy/split.1/text", "a") as f:
        f.write("utt999 X\n")
    failed = run_snakemake(wd, "--forcerun", "merge")
    assert failed.returncode != 0 and not (wd / "results/upper/toy/merged.json").exists()
    wer = run_cli(wd, "wer", "--hyp", "results/upper/toy/text", "--ref", "data/ref")
    assert wer.returncode == 1 and "WER" not in wer.stdout
    assert "results/upper/toy is not merged (no merged.json): run snakemake first" in wer.stderr


def test_a_moved_project_says_which_sets_point_back_and_the_fix_works(tmp_path):
    """A project with an ark stage and a text stage, copied elsewhere (mtimes kept) and the original deleted:
    status says the ark set and its shards moved, with the command that fixes it, and the text set is still
    current; readers refuse the moved set; the command recomputes it, after which its scp files point into
    the new directory (before: status said current while feats.scp pointed at the deleted copy)."""
    old = project(tmp_path / "old", runner="ArrayRunner", shards=2)
    config = read_config(old)
    config["stages"]["upper"] = {"runner": "toy.UpperRunner", "provider": "toy.ToyProvider", "provider_config": {},
                                 "datasets": ["toy"], "sharding": {"num_shards": 2}}
    write_config(old, config)
    assert run_snakemake(old).returncode == 0
    new = tmp_path / "new"
    shutil.copytree(old, new, symlinks=True)  # cp -a: contents and mtimes
    shutil.rmtree(old)
    assert "Nothing to be done" in run_snakemake(new, "-n").stdout  # Snakemake sees nothing to redo
    status = run_cli(new, "status")
    assert status.returncode == 0, status.stderr
    out = status.stdout
    fix = "recompute them here: snakemake --profile <your profile> --forcerun shard_s"
    assert "split.0     moved" in out and f"computed in {old}/results/s/toy/split.0: its scp files point there" in out
    assert f"merged: moved (made in {old}/results/s/toy, and its scp files point there; snakeshard refuses to " \
           f"read it): {fix}" in out
    upper = out[out.index("stage upper"):out.index("summary")]
    assert "merged: yes, current" in upper and "moved" not in upper
    assert "summary: 2 done, 2 moved" in out
    from snakeshard import load_dataset
    from snakeshard.core.merge import StaleMergedOutput
    from snakeshard.workflow.parse import read_fingerprints

    spec = {"name": "toy", "format": "stage", "path": str(new / "results/s/toy"),
            "source": {"name": "toy", "path": str(new / "data/toy"), "format": "kaldi"},
            "upstream_inputs": read_fingerprints(new / "results/s/toy")["inputs"]}
    cwd = os.getcwd()
    os.chdir(new)
    try:
        with pytest.raises(StaleMergedOutput, match="was merged in .*old/results/s/toy .*forcerun shard_s"):
            load_dataset(spec)
    finally:
        os.chdir(cwd)
    redo = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2",
                           "--forcerun", "shard_s"], cwd=new, capture_output=True, text=True, timeout=600)
    assert redo.returncode == 0, redo.stderr[-3000:]
    status = run_cli(new, "status").stdout
    assert "moved" not in status and status.count("merged: yes, current") == 2, status
    feats = kaldiio.load_scp(str(new / "results/s/toy/feats.scp"))
    assert all(path.startswith(str(new)) for path in (new / "results/s/toy/feats.scp").read_text().split()[1::2])
    assert np.array_equal(feats["utt007"], np.full((2, 3), 7, np.float32))


def test_driver_killed_while_the_canary_runs_then_one_rerun_finishes_the_workflow(tmp_path):
    """kill -9 of snakemake while the canary job runs (the orphaned job finishes its done), then the recovery of
    docs/failures-and-reruns.md (--unlock, rerun): one rerun runs the canary again, every shard and the merge
    (before: it ran the canary alone, said "1 of 1 steps (100%) done", and left 4 shards pending)."""
    import psutil

    keys = KEYS[:8]
    wd = toy_project(tmp_path / "wf", keys=keys, canary=2)
    set_provider_config(wd, stage="upper", item_delay=1.5)  # kept: another config would be another canary
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"],
                              cwd=wd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def canary_process():
        for proc in psutil.process_iter(["cmdline", "cwd"]):
            cmd = proc.info["cmdline"] or []
            if "run-shard" in cmd and "canary" in cmd and proc.info["cwd"] == str(wd):
                return proc
        return None

    canary = wait_for(canary_process, 60, "the canary job")
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    canary.wait(timeout=60)  # the orphan finishes: its done exists, Snakemake's metadata calls it incomplete
    assert list((wd / "results/upper/_canary").glob("*/done"))
    assert run_snakemake(wd, "--unlock").returncode == 0
    rerun = run_snakemake(wd)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "7 of 7 steps (100%) done" in rerun.stderr
    assert (wd / "results/upper/toy/text").read_text().count("\n") == len(keys)
    assert "merged: yes, current" in run_cli(wd, "status").stdout


def test_the_next_merge_removes_temp_files_a_killed_merge_left(tmp_path):
    """A merge killed before its renames leaves .NAME.<hex>.tmp beside the merged files; the next merge of the
    set removes those (and only those: other dot files and look-alikes stay)."""
    wd = toy_project(tmp_path / "wf")
    assert run_snakemake(wd).returncode == 0
    set_dir = wd / "results/upper/toy"
    ours = [".text.0123456789ab.tmp", ".merged.json.abcdef012345.tmp", ".fields.json.00ff00ff00ff.tmp"]
    not_ours = [".notes.tmp", ".text.xyz.tmp", "text.0123456789ab.tmp", ".text.0123456789ab.tmp.keep"]
    for name in ours + not_ours:
        (set_dir / name).write_text("partial")
    run = run_snakemake(wd, "--forcerun", "merge")
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in set_dir.iterdir() if p.name in ours + not_ours) == sorted(not_ours)


def test_keys_with_control_characters_are_refused_at_parse_naming_key_and_line(tmp_path):
    """A NUL (or another control character) in a key: `snakemake -n` fails naming the key as repr shows it
    and its file and line (before: planned, and a failure later named another key)."""
    wd = toy_project(tmp_path / "wf")
    for bad in ("utt0\x0041", "utt\x1b[31m", "utt\x7f"):
        make_kaldi_dir(wd / "data/toy", KEYS + [bad], Path(WAV))
        dry = run_snakemake(wd, "-n")
        assert dry.returncode != 0
        assert f"key(s) are empty or contain whitespace or control characters: {bad!r} (data/toy/wav.scp:41)" in \
            dry.stdout + dry.stderr


@pytest.mark.parametrize("shards_per_job", [1, 2])
def test_a_status_with_another_config_during_a_run_cannot_make_its_jobs_compute_that_config(tmp_path, shards_per_job):
    """Every parse (`snakeshard status`, `snakemake -n`) rewrites each set's spec.json, which shard jobs read. A user
    trial edited the config for a moment during a run and ran `snakeshard status`: the jobs that started after it
    computed the edited config under the run's fingerprint, the rerun with the config back did nothing, and 6 of 10
    merged values were wrong with status saying `merged: yes, current`. Now such a job refuses the spec, and the
    rerun computes every shard with the config as it is."""
    keys = KEYS[:8]
    wd = toy_project(tmp_path / "wf", keys=keys)
    config = read_config(wd)
    config["stages"]["upper"].update(sharding={"num_shards": 8}, shards_per_job=shards_per_job,
                                     provider_config={"item_delay": 1.0})
    write_config(wd, config)
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "1"],
                              cwd=wd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: list((wd / "results/upper/toy").glob("split.*/done")), 120, "a shard's done")
    edited = read_config(wd)
    edited["stages"]["upper"]["provider_config"]["suffix"] = "-edited"
    write_config(wd, edited)
    assert run_cli(wd, "status").returncode == 0
    write_config(wd, config)  # back as it was, while the run goes on
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode != 0
    assert "spec.json was rewritten for another config while this run was going" in stderr
    assert "nothing was computed: run snakemake again" in stderr
    rerun = run_snakemake(wd)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (wd / "results/upper/toy/text").read_text() == "".join(f"{k} {k.upper()}\n" for k in keys)
    assert "merged: yes, current" in run_cli(wd, "status").stdout
