"""Degenerate data and vanishing causes: each fails with one line naming key, file and line (or shard and
path), at plan time where the plan can see it, and that line reaches Snakemake's own output.

Real `snakemake` runs over the six-key audio project of test_inputs_changed (one key per shard).
Disk-full and read-only cases mount a small tmpfs as output_dir (needs root, as on this project's
machines and CI; skipped elsewhere, saying so).
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import read_config, run_cli, run_snakemake, write_config
from snakeshard.core.data import Item, read_items
from test_inputs_changed import KEYS, SET, make_audio_project, merged, write_wav

ERROR = "snakeshard: error: "


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_audio_project(tmp_path / "wf")


def error_lines(proc) -> list[str]:
    """The `snakeshard: error:` lines in Snakemake's own output (stdout and stderr)."""
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(ERROR)]


def fails_with(wd: Path, *fragments: str, args=()) -> str:
    """Run snakemake expecting failure; return the one error line holding every fragment."""
    proc = run_snakemake(wd, *args)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    for line in error_lines(proc) or text.splitlines():
        if all(f in line for f in fragments):
            return line
    raise AssertionError(f"no line with {fragments} in:\n{text[-4000:]}")


def test_truncated_wav_fails_its_key_naming_file_and_line(project):
    """k2.wav cut to half its bytes (header still says 0.5 s; libsndfile would quietly read 0.25 s)."""
    wav = project / "data/six/wav/k2.wav"
    data = wav.read_bytes()
    wav.write_bytes(data[: 44 + (len(data) - 44) // 2])
    line = fails_with(project, "shard 2", "key 'k2' (data/six/wav.scp:3)", "k2.wav is truncated",
                      "its header says 0.500 s, the file holds 0.250 s")
    assert line.startswith(ERROR)
    assert not (project / SET / "split.2/done").exists()
    assert all((project / SET / f"split.{n}/done").is_file() for n in (0, 1, 3, 4, 5))


def test_a_shard_with_several_bad_files_fails_once_naming_them_all(project):
    """One shard of the six keys (num_shards: 1) with three bad files: the first one read (k1, truncated) fails
    the shard, and the same line names the other two from their headers (k3 at 8 kHz, k4 empty), so one fix and
    one rerun finish it. Before, each bad file took a run of its own: a shard of 1,000 keys with 20 bad files,
    20 runs. A key whose audio reads is not named. (With a canary, it reads its own few keys first: a bad file
    among them fails it alone, and the next run's shard names the rest.)"""
    config = read_config(project)
    config["canary"] = 0
    config["stages"]["energy"]["sharding"] = {"num_shards": 1}
    config["stages"]["energy"]["sample_rate"] = 16000
    write_config(project, config)
    wavs = project / "data/six/wav"
    good = {k: (wavs / f"{k}.wav").read_bytes() for k in ("k1", "k3", "k4")}
    (wavs / "k1.wav").write_bytes(good["k1"][: 44 + (len(good["k1"]) - 44) // 2])
    data, _ = sf.read(wavs / "k3.wav", dtype="int16")
    sf.write(wavs / "k3.wav", data[::2], 8000, subtype="PCM_16")
    sf.write(wavs / "k4.wav", np.zeros(0, dtype="int16"), 16000, subtype="PCM_16")
    line = fails_with(project, "shard 0", "key 'k1' (data/six/wav.scp:2)", "k1.wav is truncated",
                      "; 2 other key(s) of this shard fail too, from their headers: ",
                      "key 'k3' (data/six/wav.scp:4): data/six/wav/k3.wav is 8000 Hz, the stage expects 16000 Hz",
                      "key 'k4' (data/six/wav.scp:5): data/six/wav/k4.wav holds no samples (0 frames)")
    assert not any(f"'{k}'" in line for k in ("k0", "k2", "k5"))
    assert not (project / SET / "split.0/done").exists()
    for key, data in good.items():
        (wavs / f"{key}.wav").write_bytes(data)
    assert run_snakemake(project).returncode == 0


def test_zero_sample_wav_is_refused(project):
    sf.write(project / "data/six/wav/k1.wav", np.zeros(0, dtype="int16"), 16000, subtype="PCM_16")
    fails_with(project, "shard 1", "key 'k1' (data/six/wav.scp:2)", "holds no samples (0 frames)")


def test_zero_sample_wav_is_refused_at_plan_time_when_the_plan_reads_headers(project):
    """shard_seconds reads each header: the empty file fails the plan (the dry run), naming key and line."""
    sf.write(project / "data/six/wav/k1.wav", np.zeros(0, dtype="int16"), 16000, subtype="PCM_16")
    config = read_config(project)
    config["stages"]["energy"]["sharding"] = {"shard_seconds": 1.0}
    write_config(project, config)
    fails_with(project, "key 'k1' (data/six/wav.scp:2)", "holds no samples", args=("-n",))


def test_every_unreadable_header_the_plan_needs_is_named_in_one_dry_run(project):
    """shard_seconds reads each header: a garbage file and an empty one fail the plan together, each named with
    key, line and file, with what to do (a user trial: one per run, and no word on the fix)."""
    (project / "data/six/wav/k1.wav").write_bytes(b"<html>not audio</html>\n")
    sf.write(project / "data/six/wav/k4.wav", np.zeros(0, dtype="int16"), 16000, subtype="PCM_16")
    config = read_config(project)
    config["stages"]["energy"]["sharding"] = {"shard_seconds": 1.0}
    write_config(project, config)
    line = fails_with(project, "2 audio file(s) with no readable header (their durations are needed to cut shards "
                      "by seconds): key 'k1' (data/six/wav.scp:2): cannot read audio header of data/six/wav/k1.wav: ",
                      "; key 'k4' (data/six/wav.scp:5): data/six/wav/k4.wav holds no samples (0 frames). Fix or "
                      "replace these files, or remove their lines", args=("-n",))
    assert line.startswith(ERROR)


@pytest.mark.parametrize("line, message", [
    ("k3 k3 0.40 0.40", "segment 'k3' ends at 0.40 s, not after its start 0.40 s"),
    ("k3 k3 0.40 0.10", "segment 'k3' ends at 0.10 s, not after its start 0.40 s"),
    ("k3 k3 -0.1 0.10", "segment 'k3' starts at -0.1 s, before its recording"),
    ("k3 k3 0.0 nan", "end of 'k3' 'nan' is not a finite number of seconds"),
])
def test_bad_segment_times_fail_the_plan(project, line, message):
    """Before: end <= start counted as -0.5 s in the plan. Now: plan-time error naming segments:line."""
    lines = [f"{k} {k} 0.0 0.25" for k in KEYS]
    lines[3] = line
    (project / "data/six/segments").write_text("\n".join(lines) + "\n")
    fails_with(project, "data/six/segments:4", message, args=("-n",))


def test_segment_past_the_end_is_cut_within_kaldis_tolerance_and_an_error_beyond_it(project):
    """k4 is 0.5 s. A segment to 0.8 s is cut at the end of the recording, as Kaldi's extract-segments cuts up to
    0.5 s past it (the default: a user trial's rounded segment times overshot by 1-5 ms and failed). A segment to
    1.2 s fails naming key, line, the overshoot allowed and the config key; `max_segment_overshoot: 1.0` cuts it
    too; 0 refuses any overshoot."""
    def segments(end: float) -> None:
        (project / "data/six/segments").write_text("".join(
            f"{k} {k} 0.0 {end if k == 'k4' else 0.25}\n" for k in KEYS))

    segments(0.8)
    assert run_snakemake(project).returncode == 0
    assert b"k4 8000\n" in merged(project)["samples"]
    segments(1.2)
    fails_with(project, "shard 4", "key 'k4' (data/six/segments:5)", "segment 0.0-1.2 s ends past the end",
               "(0.500 s) by more than max_segment_overshoot=0.5 s", "datasets.six.max_segment_overshoot")
    config = read_config(project)
    config["datasets"]["six"]["max_segment_overshoot"] = 1.0
    write_config(project, config)
    assert run_snakemake(project).returncode == 0
    assert b"k4 8000\n" in merged(project)["samples"]
    config["datasets"]["six"]["max_segment_overshoot"] = 0
    write_config(project, config)
    segments(0.51)
    fails_with(project, "shard 4", "segment 0.0-0.51 s ends past the end", "(0.500 s); fix the segment or set "
               "datasets.six.max_segment_overshoot")


def test_sample_rate_other_than_the_stage_declares_is_refused_by_the_library(project):
    """`stages.energy.sample_rate: 16000` and an 8 kHz file: load_audio refuses it, naming key, file, both rates."""
    write_wav(project / "data/six/wav/k5.wav", seed=5)
    data, _ = sf.read(project / "data/six/wav/k5.wav", dtype="int16")
    sf.write(project / "data/six/wav/k5.wav", data[::2], 8000, subtype="PCM_16")
    config = read_config(project)
    config["stages"]["energy"]["sample_rate"] = 16000
    write_config(project, config)
    fails_with(project, "shard 5", "key 'k5' (data/six/wav.scp:6)", "k5.wav is 8000 Hz, the stage expects 16000 Hz")


NAN_MODULE = '''
from snakeshard import BaseRunner, EnvironmentProvider


class Provider(EnvironmentProvider):
    def build_env_local(self):
        return {}


class NanRunner(BaseRunner):
    @staticmethod
    def forward(key):
        return {"score": float("nan") if key == "k3" else 1.5, "loss": float("inf") if key == "k1" else 0.0}
'''


def test_forward_returning_nan_fails_naming_key_and_field_unless_allowed(project):
    (project / "nanstage.py").write_text(NAN_MODULE)
    config = read_config(project)
    config["stages"]["energy"].update(runner="nanstage.NanRunner", provider="nanstage.Provider")
    write_config(project, config)
    fails_with(project, "shard 3", "item 'k3': field 'score' is nan", "allow_nonfinite")
    fails_with(project, "shard 1", "item 'k1': field 'loss' is inf")
    config["stages"]["energy"]["allow_nonfinite"] = ["score", "loss"]
    write_config(project, config)
    assert run_snakemake(project).returncode == 0
    assert b"k3 nan\n" in (project / SET / "score").read_bytes()


def test_nan_in_a_slice_of_plain_results_is_caught_in_process(tmp_path):
    """The bulk writer path (many plain results at once) declines a NaN; the item path names it."""
    from snakeshard import BaseRunner
    from snakeshard.core.shard import run_shard
    from snakeshard.errors import ShardError

    class Runner(BaseRunner):
        @staticmethod
        def forward(key):
            return {"x": math.nan if key == "k50" else 1.0}

    keys = [f"k{i}" for i in range(100)]
    with pytest.raises(ShardError, match="item 'k50': field 'x' is nan"):
        run_shard(Runner, {}, keys, tmp_path / "s", progress=False)
    run_shard(Runner, {}, keys, tmp_path / "s", progress=False, allow_nonfinite=["x"])
    assert "k50 nan\n" in (tmp_path / "s/x").read_text()


@pytest.mark.parametrize("value, message", [
    ("0", "duration of 'k2' is '0'; a duration must be > 0"),
    ("-1.5", "duration of 'k2' is '-1.5'; a duration must be > 0"),
    ("nan", "duration of 'k2' 'nan' is not a finite number of seconds"),
])
def test_bad_durations_fail_the_plan(project, value, message):
    (project / "data/six/utt2dur").write_text("".join(f"{k} {value if k == 'k2' else 0.5}\n" for k in KEYS))
    fails_with(project, "data/six/utt2dur:3", message, args=("-n",))


def test_non_utf8_wav_scp_names_file_line_and_column(project):
    scp = project / "data/six/wav.scp"
    lines = scp.read_bytes().split(b"\n")
    lines[4] = b"k4\xe9 data/six/wav/k4.wav"
    scp.write_bytes(b"\n".join(lines))
    fails_with(project, "data/six/wav.scp:5: not UTF-8", "column 3", args=("-n",))
    proc = run_cli(project, "plan")
    assert proc.returncode == 1 and "data/six/wav.scp:5: not UTF-8" in proc.stderr


def canary_off(wd: Path) -> None:
    """`canary: 0`: a bad first key (k0, one of the canary's) is then shard 0's error, not the canary's."""
    config = read_config(wd)
    config["canary"] = 0
    write_config(wd, config)


def test_failing_pipe_error_carries_the_pipes_own_stderr(project):
    canary_off(project)
    scp = project / "data/six/wav.scp"
    scp.write_text(scp.read_text().replace("k0 data/six/wav/k0.wav",
                                           "k0 sox data/six/wav/missing.wav -t wav - 2>&1 >/dev/null | cat >&2; "
                                           "echo 'decoder: no such codec' >&2; exit 3 |"))
    fails_with(project, "shard 0", "key 'k0' (data/six/wav.scp:1)", "exited with status 3",
               "its stderr:", "decoder: no such codec")


def test_pipe_writing_nothing_is_refused(project):
    canary_off(project)
    scp = project / "data/six/wav.scp"
    scp.write_text(scp.read_text().replace("k0 data/six/wav/k0.wav", "k0 true |"))
    fails_with(project, "shard 0", "audio pipe 'true' wrote no bytes")


BROKEN_PROVIDER = '''
from snakeshard import EnvironmentProvider


class Provider(EnvironmentProvider):
    def build_env_local(self):
        raise FileNotFoundError("model.ckpt is not there")
'''


def test_provider_build_failure_gives_a_shard_error_line_in_snakemakes_output(project):
    """Before: a raw traceback in the log and no `snakeshard: error: shard N` line anywhere. (With the canary on, the
    canary's line: tests/test_first_contact.py.)"""
    canary_off(project)
    (project / "broken.py").write_text(BROKEN_PROVIDER)
    config = read_config(project)
    config["stages"]["energy"]["provider"] = "broken.Provider"
    write_config(project, config)
    line = fails_with(project, "shard 0 (log: results/energy/six/logs/split.0.log)", "the provider broken.Provider "
                      "failed to build the env: FileNotFoundError: model.ckpt is not there")
    log = (project / SET / "logs/split.0.log").read_text()
    assert "Traceback" in log and log.strip().endswith(line)


def test_read_items_record_per_source_file(project):
    """What the shard fingerprint covers per key, straight from the files."""
    (project / "data/six/segments").write_text("u0 k0 0.0 0.25\n")
    (project / "data/six/utt2spk").write_text("u0 spk1\n")
    (project / "data/six/text").write_text("u0 hello world\n")
    items = read_items({"path": str(project / "data/six")})
    assert items == [Item("u0", f"{project}/data/six/segments:1", audio="data/six/wav/k0.wav", seconds=0.25,
                          fields={"rec": "k0", "start": 0.0, "end": 0.25, "text": "hello world", "spk": "spk1"},
                          records={"wav.scp": "data/six/wav/k0.wav", "segments": "k0 0.0 0.25",
                                   "text": "hello world", "utt2spk": "spk1"})]


# -- a full or read-only output_dir: a tmpfs mounted for the test -------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs at tmp_path/disk (root only); unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


BIG_MODULE = '''
from snakeshard import BaseRunner, EnvironmentProvider


class Provider(EnvironmentProvider):
    def build_env_local(self):
        return {}


class BigRunner(BaseRunner):
    @staticmethod
    def forward(key):
        return {"blob": key * 100_000}  # 200 kB per key: six keys overflow a 1 MiB disk
'''


def test_disk_full_cause_reaches_snakemakes_output_and_a_rerun_recovers(project, small_disk):
    """Shard results and their logs on a full disk: before, in 5 of 14 runs 'No space left on device'
    appeared nowhere. Now every failed shard's line, with the cause, is in Snakemake's own output;
    no failed shard has a done; after freeing space the rerun completes."""
    (project / "big.py").write_text(BIG_MODULE)
    config = read_config(project)
    config["output_dir"] = str(small_disk / "results")
    config["stages"]["energy"].update(runner="big.BigRunner", provider="big.Provider")
    write_config(project, config)
    proc = run_snakemake(project)
    assert proc.returncode != 0
    # in the lines, not at their start: Snakemake's "Logfile ...: empty file" of another failed job and this job's
    # own line, written to the same stderr at once, can share a line (1 run in ~12 under load, 2026-11-27)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "No space left on device" in line]
    set_dir = small_disk / "results/energy/six"
    failed = [n for n in range(6) if not (set_dir / f"split.{n}/done").exists()]
    assert failed, "the disk never filled"
    for n in failed:
        assert any(f"{ERROR}shard {n} " in line for line in lines), (n, lines)
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    assert run_snakemake(project).returncode == 0
    assert (set_dir / "blob").read_text() == "".join(f"{k} {k * 100_000}\n" for k in KEYS)


def test_full_disk_at_parse_names_the_path(project, small_disk):
    config = read_config(project)
    config["output_dir"] = str(small_disk / "results")
    write_config(project, config)
    with open(small_disk / "filler", "wb") as f:
        try:
            f.write(b"\0" * (2 << 20))
        except OSError:
            pass
    line = fails_with(project, "output_dir: cannot write", str(small_disk / "results"), "No space left on device",
                      args=("-n",))
    assert "Traceback" not in line


def test_read_only_output_dir_at_parse_names_the_path(project, small_disk):
    config = read_config(project)
    config["output_dir"] = str(small_disk / "results")
    write_config(project, config)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    fails_with(project, "output_dir: cannot write", str(small_disk / "results"), "Read-only file system",
               args=("-n",))
    proc = run_cli(project, "status")
    assert proc.returncode == 1 and "Read-only file system" in proc.stderr and str(small_disk) in proc.stderr


def test_mixed_str_and_float_field_still_writes_in_bulk(tmp_path):
    """A field holding floats for some keys and strings for others is plain: written, not an error."""
    from snakeshard import BaseRunner
    from snakeshard.core.shard import run_shard

    class Runner(BaseRunner):
        @staticmethod
        def forward(key):
            return {"x": "n/a" if key == "k3" else 0.5}

    run_shard(Runner, {}, [f"k{i}" for i in range(8)], tmp_path / "s", progress=False)
    assert (tmp_path / "s/x").read_text().splitlines()[3] == "k3 n/a"


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_segments_read_alone_and_a_pipe_runs_once_per_recording(tmp_path, fmt):
    """Segments of a file are read alone (a seek), of a pipe from one run of it for all segments of its recording
    (a Kaldi user's trial: a pipe run per segment took 189 s against 4.4 s for the same recording as a file). Both
    give the samples of the whole recording cut, as before, in plan order and in an interleaved order (a batch
    sorted by length), and what a caller writes into one segment's samples does not reach the next."""
    from snakeshard import load_dataset

    rng = np.random.default_rng(3)
    recordings = {f"r{n}": (rng.standard_normal((16000 * 5, 2 if n == 2 else 1)) * 0.1).squeeze() for n in range(3)}
    count = tmp_path / "runs"
    d = tmp_path / "d"
    d.mkdir()
    scp, segments = [], []
    for name, samples in recordings.items():
        path = tmp_path / f"{name}.{fmt.lower()}"
        sf.write(path, samples, 16000, format=fmt, subtype="PCM_16")
        # r0 and r2 behind a pipe that counts its runs; r1 a plain file
        scp.append(f"{name} {path}\n" if name == "r1" else f"{name} echo x >> {count}; cat {path} |\n")
        segments += [f"{name}-{i} {name} {i * 0.7:.2f} {i * 0.7 + 0.5:.2f}\n" for i in range(6)]
    (d / "wav.scp").write_text("".join(scp))
    (d / "segments").write_text("".join(segments))
    whole = {name: sf.read(tmp_path / f"{name}.{fmt.lower()}", dtype="float32")[0] for name in recordings}
    dataset = load_dataset({"path": str(d), "format": "kaldi"})
    keys = list(dataset.keys)
    for order in (keys, keys[::3] + keys[1::3] + keys[2::3]):
        for key in order:
            name, i = key.split("-")
            got, rate = dataset.load_audio(key)
            start, end = (int(float(f"{t:.2f}") * 16000) for t in (int(i) * 0.7, int(i) * 0.7 + 0.5))
            assert rate == 16000 and np.array_equal(got, whole[name][start:end]), key
            got[:] = 0  # a caller's in-place edit
    assert count.read_text() == "x\nx\n"  # r0 and r2, once each, over both orders


def test_a_segment_to_the_end_of_its_recording_and_reco2dur_as_kaldi_reads_them(tmp_path):
    """Kaldi's extract-segments reads an end time of -1 as the end of the recording, and a dir without segments may
    give its durations as reco2dur (a Kaldi user's trial: both refused). A 5th column (a channel) is named."""
    from snakeshard import load_dataset
    from snakeshard.core.manifest import scan_manifest
    from snakeshard.core.plan import shard_counts
    from snakeshard.errors import DataError

    samples = (np.random.default_rng(5).standard_normal(16000 * 3) * 0.1).astype(np.float32)
    wav = tmp_path / "rec.wav"
    sf.write(wav, samples, 16000, subtype="FLOAT")
    d = tmp_path / "d"
    d.mkdir()
    (d / "wav.scp").write_text(f"file {wav}\npiped cat {wav} |\n")
    (d / "segments").write_text("file-a file 0 1\nfile-b file 1 -1\npiped-b piped 2.5 -1\n")
    spec = {"path": str(d), "format": "kaldi"}
    dataset = load_dataset(spec)
    assert np.array_equal(dataset.load_audio("file-b")[0], samples[16000:])
    assert np.array_equal(dataset.load_audio("piped-b")[0], samples[40000:])
    # durations: the open end's from the file's header; behind a pipe, from reco2dur, else an error naming both
    with pytest.raises(DataError, match=r"key 'piped-b' \(.*segments:3\): cannot read a duration from .* give "
                                        r"its recording's duration in reco2dur \(its segment ends at -1\) or shard "):
        shard_counts(scan_manifest(spec), {"num_shards": 2})
    (d / "reco2dur").write_text("file 3.0\npiped 3.0\n")
    manifest = scan_manifest(spec)
    assert shard_counts(manifest, {"num_shards": 2}) == [1, 2] and list(manifest.seconds) == [1.0, 2.0, 0.5]
    # without segments: reco2dur is the dir's utt2dur
    (d / "segments").unlink()
    assert list(scan_manifest(spec).seconds) == [3.0, 3.0]
    (d / "segments").write_text("file-a file 0 1 0\n")
    with pytest.raises(DataError, match=r"segments:1: 'file-a file 0 1 0' has a 5th column \(a channel\), which "):
        load_dataset(spec)
