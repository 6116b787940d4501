"""A shell command as a stage (stages/command.py): Kaldi-style tools run per shard over a Kaldi data dir of its keys.

No Kaldi binary installs here: two scripts below stand in for ``compute-fbank-feats`` and ``feat-to-len`` (they read
``scp:`` and write ``ark,scp:`` and ``ark,t:`` as Kaldi's tools do, with kaldi-native-fbank and kaldiio), beside real
bash pipelines (awk, grep); the workflow around them is real snakemake.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from conftest import PROJECT, copy_workflow, read_config, run_cli, run_snakemake, write_config
from snakeshard.errors import ConfigError
from snakeshard.stages.command import CommandProvider

# compute-fbank-feats, as far as these tests need: [--config=FILE] [--num-mel-bins=N] scp:WAV_SCP ark,scp:ARK,SCP
# (a config file holds options one per line, as Kaldi's do)
KALDI_LIKE_FBANK = f"""#!{sys.executable}
import sys

import kaldiio
import soundfile

from snakeshard.stages.fbank import compute_fbank, fbank_options

args = sys.argv[1:]
options = []
while args[0].startswith("--"):
    option = args.pop(0)
    options += open(option.split("=", 1)[1]).read().split() if option.startswith("--config=") else [option]
bins = 80
for option in options:
    if option.startswith("--num-mel-bins="):
        bins = int(option.split("=")[1])
wav_scp, (ark, scp) = args[0].removeprefix("scp:"), args[1].removeprefix("ark,scp:").split(",")
opts = fbank_options({{"num_mel_bins": bins}}, 16000)
with open(wav_scp) as f, kaldiio.WriteHelper(f"ark,scp:{{ark}},{{scp}}") as writer:
    for line in f:
        key, path = line.split()
        samples, rate = soundfile.read(path, dtype="int16")
        writer(key, compute_fbank(samples.astype("float32"), opts))
        print(f"LOG (compute-fbank-feats) processed {{key}}", file=sys.stderr)
"""
# feat-to-len scp:SCP ark,t:FILE: frames per key
FEAT_TO_LEN = f"""#!{sys.executable}
import sys

import kaldiio

scp, out = sys.argv[1].removeprefix("scp:"), sys.argv[2].removeprefix("ark,t:")
with open(out, "w") as f:
    f.writelines(f"{{key}} {{len(m)}}\\n" for key, m in kaldiio.load_scp(scp).items())
"""


DEMO_KEYS = [line.split()[0] for line in (PROJECT / "data/demo/wav.scp").read_text().splitlines()]


def command_project(root: Path, provider_config: dict, sharding=None, dataset="data/demo", **stage) -> Path:
    wd = copy_workflow(root)
    (wd / "bin").mkdir()
    (wd / "bin/compute-fbank-feats").write_text(KALDI_LIKE_FBANK)
    (wd / "bin/feat-to-len").write_text(FEAT_TO_LEN)
    for tool in ("compute-fbank-feats", "feat-to-len"):
        (wd / "bin" / tool).chmod(0o755)
    (wd / "conf").mkdir()
    (wd / "conf/fbank.conf").write_text("--num-mel-bins=23\n")
    config = read_config(wd)
    config["datasets"] = {"demo": {"path": dataset}}
    config["stages"] = {"kaldi": {"runner": "snakeshard.stages.CommandRunner",
                                  "provider": "snakeshard.stages.CommandProvider",
                                  "provider_config": provider_config, "datasets": ["demo"],
                                  "sharding": sharding or {"num_shards": 3}, **stage}}
    write_config(wd, config)
    return wd


def docs_stage() -> dict:
    """The stage docs/stages.md shows (its yaml block under "Kaldi's tools as a stage")."""
    import yaml

    page = (PROJECT / "docs/stages.md").read_text()
    section = page[page.index("## Kaldi's tools as a stage"):]
    block = section[section.index("```yaml\n") + 8:section.index("```\n", section.index("```yaml\n") + 8)]
    return yaml.safe_load(block)["stages"]["kaldi_fbank"]


def test_the_docs_kaldi_command_stage_gives_the_builtin_fbank_and_reruns_on_its_config_file(tmp_path, monkeypatch):
    """docs/stages.md's stage as written, its compute-fbank-feats a stand-in on PATH: the merged features equal
    kaldi-native-fbank's (23 bins, from conf/fbank.conf), one command per shard, its LOG lines in the shard's
    log; an edit of conf/fbank.conf (listed under files) makes every shard stale."""
    stage = docs_stage()
    wd = command_project(tmp_path / "wf", stage["provider_config"])
    monkeypatch.setenv("PATH", f"{wd / 'bin'}:{os.environ['PATH']}")
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    out = wd / "results/kaldi/demo"
    import soundfile

    from snakeshard.stages.fbank import compute_fbank, fbank_options

    opts = fbank_options({"num_mel_bins": 23}, 16000)
    feats = dict(kaldiio.load_scp(str(out / "feats.scp")))
    assert list(feats) == DEMO_KEYS
    for key in DEMO_KEYS:
        samples, _ = soundfile.read(PROJECT / f"data/demo/wav/{key}.wav", dtype="int16")
        assert np.array_equal(feats[key], compute_fbank(samples.astype("float32"), opts)), key
    assert (out / "utt2num_frames").read_text() == "".join(f"{k} {len(feats[k])}\n" for k in DEMO_KEYS)
    log = (out / "logs/split.1.log").read_text()  # the command's own output, in the shard's log
    n = len((out / "split.1/keys").read_text().split())
    assert log.count("LOG (compute-fbank-feats) processed ") == n
    assert f"split.1.log): {n} items in 1 batches (batch_size 1000)\n" in log  # one command per shard
    assert "Nothing to be done" in run_snakemake(wd, "-n").stdout
    (wd / "conf/fbank.conf").write_text("--num-mel-bins=40\n")  # a file the command reads: every shard reruns
    assert run_cli(wd, "status").stdout.count("changed since it ran: the stage") == 3
    rerun = run_snakemake(wd)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert kaldiio.load_mat((out / "feats.scp").read_text().split()[1]).shape[1] == 40


def test_a_failing_command_fails_its_shard_naming_status_keys_and_last_lines_and_keeps_the_others(tmp_path):
    command = ("if grep -q librivox_austen-0930 {data}/wav.scp; then "
               "echo 'ERROR (compute-fbank-feats) cannot open x.wav' >&2; "
               "exit 3; fi; cut -d' ' -f1 {data}/wav.scp | sed 's/$/ ok/' > {out}/status")
    wd = command_project(tmp_path / "wf", {"command": command, "reads": {"status": "status"}})
    run = run_snakemake(wd, "--keep-going")
    assert run.returncode != 0
    out = wd / "results/kaldi/demo"
    failed = [n for n in range(3) if not (out / f"split.{n}/done").exists()]
    assert failed == [2], failed
    line = next(line for line in (out / "logs/split.2.log").read_text().splitlines()
                if line.startswith("snakeshard: error:"))
    assert re.search(r"shard 2.*: the command over (key 'librivox_austen-0930'|\d+ keys \('librivox_\S+'\.\."
                     r"'librivox_austen-0930'\)) exited with status 3 \(stages\.kaldi\.provider_config\.command: "
                     r"if grep -q librivox_austen-0930 \{data\}/wav\.scp; .*\); its last lines: "
                     r"ERROR \(compute-fbank-feats\) cannot open x\.wav$", line), line
    assert "ERROR (compute-fbank-feats) cannot open x.wav" in run_cli(wd, "status").stdout


@pytest.mark.parametrize("command, message", [
    # a Kaldi tool that skips a key it failed on: every key is wanted
    ("grep -v cards-002 {data}/text > {out}/text",
     r"text: the command wrote 2 of the batch's 3 keys; missing: 'cards-002' \(a Kaldi tool skips a key it fails "
     r"on: the WARNING above in this log says why\)"),
    ("(cat {data}/text; echo 'other-key x') > {out}/text",
     r"text:4 \(written by stages\.kaldi\.provider_config\.command\): key 'other-key' is not one of the batch's keys"),
    ("echo {out} > /dev/null",
     r"the command wrote no text in \{out\} \(stages\.kaldi\.provider_config\.reads names it\)"),
])
def test_a_command_that_writes_other_keys_than_its_batch_fails_naming_the_key(tmp_path, command, message):
    wd = command_project(tmp_path / "wf", {"command": command, "reads": {"text": "text"}}, {"shard_size": 3},
                         canary=0)  # split.0 itself, not the canary's first key
    run = run_snakemake(wd)
    assert run.returncode != 0
    log = (wd / "results/kaldi/demo/logs/split.0.log").read_text()
    assert re.search(message, log), log[-2000:]


@pytest.mark.skipif(shutil.which("soxi") is None, reason="needs sox's soxi")
def test_a_real_tool_over_each_shards_wav_scp_gives_the_datasets_durations(tmp_path):
    """sox's soxi over each shard's {data}/wav.scp, as a user's own script would read it: the merged durations are
    the shipped utt2dur's (rounded as it is), in the dataset's order, from 3 shards."""
    command = "while read key wav; do echo \"$key $(soxi -D $wav)\"; done < {data}/wav.scp > {out}/utt2dur"
    wd = command_project(tmp_path / "wf", {"command": command, "reads": {"utt2dur": "utt2dur"}})
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    got = [line.split() for line in (wd / "results/kaldi/demo/utt2dur").read_text().splitlines()]
    want = [line.split() for line in (PROJECT / "data/demo/utt2dur").read_text().splitlines()]
    assert [k for k, _ in got] == [k for k, _ in want] == DEMO_KEYS
    assert all(abs(float(a) - float(b)) < 1e-3 for (_, a), (_, b) in zip(got, want))


def test_batch_size_gives_each_command_at_most_that_many_keys(tmp_path):
    """10 keys in one shard, batch_size 4: three commands over 4, 4 and 2 keys, in plan order."""
    command = "n=$(wc -l < {data}/wav.scp); awk -v n=$n '{print $1, n}' {data}/wav.scp > {out}/batch"
    wd = command_project(tmp_path / "wf", {"command": command, "reads": {"batch": "batch"}}, {"num_shards": 1},
                         batch_size=4)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (wd / "results/kaldi/demo/batch").read_text().split()[1::2] == ["4"] * 8 + ["2"] * 2


def test_segments_and_pipes_reach_the_command_as_kaldi_writes_them(tmp_path):
    """A dir of segments cut from piped recordings: {data} holds each recording once in wav.scp (its pipe as
    written), the segments' times, spk2utt from utt2spk; sox reads them as Kaldi's extract-segments would."""
    data = tmp_path / "seg"
    data.mkdir()
    wav = PROJECT / "data/demo/wav/cards-001.wav"
    (data / "wav.scp").write_text(f"rec1 {wav}\nrec2 sox {wav} -t wav - |\n")
    (data / "segments").write_text("rec1-a rec1 0 0.5\nrec1-b rec1 0.5 -1\nrec2-a rec2 0.25 0.75\n")
    (data / "utt2spk").write_text("rec1-a s1\nrec1-b s1\nrec2-a s2\n")
    command = ("cp {data}/wav.scp {out}/wav_lines && awk '{print $1, $3 \"-\" $4}' {data}/segments > {out}/times && "
               "awk '{print $2, $1}' {data}/utt2spk | sort > /dev/null && "
               "while read spk utts; do for u in $utts; do echo \"$u $spk:$(echo $utts | wc -w)\"; done; done "
               "< {data}/spk2utt > {out}/spk")
    wd = command_project(tmp_path / "wf", {"command": command, "reads": {"times": "times", "spk": "spk"}},
                         {"num_shards": 1}, dataset=str(data))
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    out = wd / "results/kaldi/demo"
    assert (out / "times").read_text() == "rec1-a 0-0.5\nrec1-b 0.5--1\nrec2-a 0.25-0.75\n"
    assert (out / "spk").read_text() == "rec1-a s1:2\nrec1-b s1:2\nrec2-a s2:1\n"


def test_a_features_dir_reaches_the_command_as_its_feats_scp(tmp_path):
    """Kaldi's features (a dir of feats.scp alone) through a command reading scp:{data}/feats.scp."""
    data = tmp_path / "feats"
    data.mkdir()
    rng = np.random.default_rng(0)
    want = {f"k{i}": rng.normal(size=(5 + i, 4)).astype(np.float32) for i in range(6)}
    with kaldiio.WriteHelper(f"ark,scp:{data}/f.ark,{data}/feats.scp") as writer:
        for key, m in want.items():
            writer(key, m)
    copy = (f"{sys.executable} -c \"import kaldiio, sys; w = kaldiio.WriteHelper('ark,scp:' + sys.argv[2] + '.ark,' + "
            "sys.argv[2] + '.scp'); [w(k, 2 * m) for k, m in kaldiio.load_scp(sys.argv[1]).items()]; w.close()\" "
            "{data}/feats.scp {out}/doubled")
    wd = command_project(tmp_path / "wf", {"command": copy, "reads": {"doubled": "doubled.scp"}}, {"shard_size": 4},
                         dataset=str(data))
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    got = dict(kaldiio.load_scp(str(wd / "results/kaldi/demo/doubled.scp")))
    assert list(got) == list(want) and all(np.array_equal(got[k], 2 * want[k]) for k in want)


@pytest.mark.parametrize("config, message", [
    ({"reads": {"x": "x"}}, r"provider_config\.command: give the shell command"),
    ({"command": "true > {out}/x"}, r"provider_config\.reads: give the files the command writes in \{out\}"),
    ({"command": "true", "reads": {"x": "x"}}, r"provider_config\.command: it must write \['x'\] into \{out\}"),
    ({"command": "true > {out}/x", "reads": {"x": "sub/x"}}, r"reads: 'sub/x' must be a file name in \{out\}"),
    ({"command": "true > {out}/x", "reads": {"x": "x"}, "files": ["conf/missing.conf"]},
     r"provider_config\.files\[0\]: 'conf/missing\.conf' is not a file"),
])
def test_config_errors_name_the_key(config, message):
    with pytest.raises(ConfigError, match=message):
        CommandProvider({**config, "dataset": {"path": str(PROJECT / "data/demo"), "name": "demo"}}).build_env_local()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_command_runs_under_pipefail(tmp_path):
    """A pipeline whose first command fails fails the shard (Kaldi's scripts run with pipefail too)."""
    wd = command_project(tmp_path / "wf", {"command": "false | cat {data}/text > {out}/text",
                                           "reads": {"text": "text"}}, {"num_shards": 1})
    run = run_snakemake(wd)
    assert run.returncode != 0
    assert "exited with status 1" in run.stdout + run.stderr, run.stderr[-2000:]
    assert subprocess.run(["bash", "-c", "false | cat"]).returncode == 0  # what bash does without it
