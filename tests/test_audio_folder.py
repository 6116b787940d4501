"""A folder of audio files as a dataset: `snakeshard init --data FOLDER` and `snakeshard manifest FOLDER` write its
JSON Lines manifest (key, absolute audio path, duration, the columns of a Hugging Face style metadata.csv), which a
real snakemake run then plans and runs. Each bad folder is refused naming the files, and leaves no project."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import yaml

from conftest import read_config

CONSOLE_SCRIPT = str(Path(sys.executable).parent / "snakeshard")
DEMO_WAV = Path(__file__).resolve().parents[1] / "data/demo/wav"


def speaker_folder(root: Path) -> Path:
    """spk1/ (2 files), "spk 2"/ (a file name with a space, as FLAC), a README, a metadata.csv with a row for a
    file that is not there and none for one that is."""
    folder = root / "folder"
    (folder / "spk1").mkdir(parents=True)
    (folder / "spk 2").mkdir()
    shutil.copy(DEMO_WAV / "cards-001.wav", folder / "spk1/a.wav")
    shutil.copy(DEMO_WAV / "cards-002.wav", folder / "spk1/b.wav")
    samples, rate = soundfile.read(DEMO_WAV / "cards-003.wav", dtype="int16")
    soundfile.write(folder / "spk 2/take one.flac", samples, rate)
    (folder / "README.txt").write_text("not audio\n")
    (folder / "metadata.csv").write_text("file_name,transcription,gender\nspk1/a.wav,ten of clubs,f\n"
                                         "spk 2/take one.flac,\"three, of hearts\",m\ngone.wav,lost,m\n")
    return folder


def test_init_with_a_folder_of_audio_writes_its_manifest_and_the_project_runs_over_it(tmp_path):
    folder = speaker_folder(tmp_path)
    init = subprocess.run([CONSOLE_SCRIPT, "init", "proj", "--data", "folder"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert init.returncode == 0, init.stderr
    project = tmp_path / "proj"
    seconds = sum(soundfile.info(f).duration for f in (folder / "spk1/a.wav", folder / "spk1/b.wav",
                                                        folder / "spk 2/take one.flac"))
    assert init.stdout.splitlines()[:2] == [
        "wrote Snakefile, config/config.yaml, my_stage.py, profiles/local/config.yaml, profiles/slurm/config.yaml, "
        "data/folder.jsonl in proj",
        f"data/folder.jsonl: 3 audio files of {folder}, {seconds:.1f} s, in 2 subfolders (field dir); fields from "
        "its metadata: gender, transcription"]
    assert init.stdout.splitlines()[2] == (f"files added to folder later: snakeshard manifest {folder} -o "
                                           "data/folder.jsonl (run in proj; they are appended: the shards before the "
                                           "last, partly filled one are kept)")
    assert read_config(project)["stages"]["energy"]["sharding"] == {"shard_size": 1}  # 3 files: ~8 shards, 1 each
    assert init.stderr.splitlines() == [
        f"note: {folder}/metadata.csv: 1 row(s) name no audio file here, left out: gone.wav",
        f"note: {folder}/metadata.csv: no row for 1 audio file(s), which get no metadata fields: spk1/b.wav"]
    assert read_config(project)["datasets"] == {"folder": {"path": "data/folder.jsonl", "format": "jsonl"}}
    records = [json.loads(line) for line in (project / "data/folder.jsonl").read_text().splitlines()]
    assert [(r["key"], r["audio"]) for r in records] == [
        ("spk_2-take_one", f"{folder}/spk 2/take one.flac"), ("spk1-a", f"{folder}/spk1/a.wav"),
        ("spk1-b", f"{folder}/spk1/b.wav")]  # sorted by path ("spk 2" < "spk1"); "/" and spaces out of the keys
    assert [r["duration"] for r in records] == [round(soundfile.info(r["audio"]).duration, 6) for r in records]
    assert records[0]["transcription"] == "three, of hearts" and records[1]["transcription"] == "ten of clubs"
    assert "transcription" not in records[2]
    assert [r["dir"] for r in records] == ["spk 2", "spk1", "spk1"]  # the subfolder: a speaker, a class

    config = read_config(project)  # a speaker's files in one shard, by their subfolder
    config["stages"]["energy"]["sharding"] = {"num_shards": 3, "keep_together": "dir"}
    (project / "config/config.yaml").write_text(yaml.safe_dump(config))
    plan = subprocess.run([CONSOLE_SCRIPT, "plan"], cwd=project, capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert re.findall(r"^\s+\d+\s+(\d+)\s+[\d.]+\s+(\S+) \.\. (\S+)$", plan.stdout, re.M) == [
        ("1", "spk_2-take_one", "spk_2-take_one"), ("2", "spk1-a", "spk1-b")], plan.stdout
    run = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local"], cwd=project,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    energy = (project / "results/energy/folder/energy_db").read_text().split()
    assert energy[0::2] == ["spk_2-take_one", "spk1-a", "spk1-b"]

    # snakeshard manifest writes the same lines (files added later: run it again)
    again = subprocess.run([CONSOLE_SCRIPT, "manifest", str(folder), "-o", str(tmp_path / "m.jsonl")],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "m.jsonl").read_bytes() == (project / "data/folder.jsonl").read_bytes()
    assert again.stdout.startswith(f"{tmp_path / 'm.jsonl'}: 3 audio files of {folder}, {seconds:.1f} s, in 2 ")


def _break_three_files(folder: Path) -> None:
    (folder / "spk1/junk.wav").write_text("not a wav")
    (folder / "spk1/empty.flac").write_bytes(b"")
    soundfile.write(folder / "spk1/no_samples.wav", np.zeros(0, dtype=np.int16), 16000)


@pytest.mark.parametrize("spoil, message", [
    (lambda f: shutil.rmtree(f) or f.mkdir() or (f / "notes.txt").write_text("x"),
     "{folder}: no audio file in it or its subfolders (looked for .aif, .aiff, .au, .caf, .flac, .mp3, .ogg, .opus, "
     ".rf64, .sph, .w64, .wav)"),
    (lambda f: shutil.copy(f / "spk1/a.wav", f / "spk1/a.flac"),
     "{folder}: spk1/a.flac and spk1/a.wav both make key 'spk1-a' (a key is the path without its suffix): rename one"),
    (_break_three_files,
     "{folder}: 3 of 6 audio files do not read (fix or remove them, then run this again): spk1/empty.flac: cannot "
     "read audio header of {folder}/spk1/empty.flac: "),
    (_break_three_files, "; spk1/no_samples.wav: holds no samples (0 frames)\n"),
    (lambda f: (f / "metadata.csv").write_text("file_name,key\nspk1/a.wav,x\n"),
     "{folder}/metadata.csv:2: column 'key' is a field the manifest writes itself (key, audio, duration); rename it"),
    (lambda f: (f / "metadata.csv").write_text("path,text\nspk1/a.wav,x\n"),
     "{folder}/metadata.csv:2: no file_name (the column that names each audio file, relative to {folder})"),
    (lambda f: (f / "metadata.csv").write_text("file_name,text\nspk1/a.wav,x\nspk1/a.wav,y\n"),
     "{folder}/metadata.csv:3: file_name 'spk1/a.wav' again (an earlier row names it too)"),
    (lambda f: (f / "metadata.csv").write_text("file_name,text\nspk1/a.wav,one, two\n"),
     "{folder}/metadata.csv:2: more values than the header has columns (2): quote a value that holds a comma"),
    (lambda f: (f / "metadata.jsonl").write_text('{"file_name": "spk1/a.wav"}\n'),
     "{folder} holds both metadata.csv and metadata.jsonl: keep one"),
    (lambda f: (f / "metadata.csv").unlink() or (f / "metadata.jsonl").write_text('{"file_name": "spk1/a.wav"}\nx\n'),
     "{folder}/metadata.jsonl:2: not a JSON object: "),
])
def test_a_bad_folder_is_refused_naming_the_files_and_no_project_is_written(tmp_path, spoil, message):
    folder = speaker_folder(tmp_path)
    spoil(folder)
    init = subprocess.run([CONSOLE_SCRIPT, "init", "proj", "--data", "folder"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert init.returncode == 1 and init.stderr.startswith("snakeshard: error: "), init.stderr
    assert message.format(folder=folder) in init.stderr, init.stderr
    assert not (tmp_path / "proj").exists()


def test_a_kaldi_dir_of_features_only_is_a_kaldi_dataset_not_a_folder_of_audio(tmp_path):
    """A dir with feats.scp and no wav.scp (Kaldi features without audio) is taken as a Kaldi dir (it was refused
    for its missing wav.scp)."""
    import kaldiio
    import numpy as np

    (tmp_path / "fd").mkdir()
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path}/fd/feats.ark,{tmp_path}/fd/feats.scp") as writer:
        for key in ("u1", "u2"):
            writer(key, np.zeros((100, 80), dtype="float32"))
    init = subprocess.run([CONSOLE_SCRIPT, "init", "proj", "--data", "fd"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert init.returncode == 0, init.stderr
    assert read_config(tmp_path / "proj")["datasets"] == {"fd": {"path": str(tmp_path / "fd"), "format": "kaldi"}}
    plan = subprocess.run([CONSOLE_SCRIPT, "plan"], cwd=tmp_path / "proj", capture_output=True, text=True)
    assert plan.returncode == 0 and "u1 .. u2" in plan.stdout, plan.stderr


def test_files_of_another_rate_or_of_two_channels_are_noted_when_the_manifest_is_written(tmp_path):
    """A stage reads one rate and one channel: the manifest names the files that differ (the rarer rate) at once,
    instead of a shard job failing on them later; the manifest still lists every file."""
    folder = speaker_folder(tmp_path)
    samples, rate = soundfile.read(DEMO_WAV / "cards-001.wav", dtype="int16")
    soundfile.write(folder / "spk1/c8k.wav", samples[::2], rate // 2)
    soundfile.write(folder / "spk1/d_stereo.wav", np.stack([samples, samples], 1), rate)
    made = subprocess.run([CONSOLE_SCRIPT, "manifest", str(folder), "-o", str(tmp_path / "m.jsonl")],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert made.stderr.splitlines()[:2] == [
        f"note: 1 file(s) at {rate // 2} Hz, the others at {rate} Hz (a stage reads one rate: resample them, e.g. sox "
        f"-D IN -r {rate} OUT): spk1/c8k.wav",
        "note: 1 file(s) of more than one channel (a stage reads one: downmix them, e.g. sox IN -c 1 OUT): "
        "spk1/d_stereo.wav"]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 5


def test_files_added_to_the_folder_are_appended_to_its_manifest_and_only_their_shards_run(tmp_path):
    """`snakeshard manifest` over the project's own manifest keeps its lines first, in their order, and appends the
    new files (sorted), also one whose path sorts before the others: the plan reads only the new lines, and with
    shard_size the shards before them are kept (the rerun after new recordings runs their shards only)."""
    folder = speaker_folder(tmp_path)
    assert subprocess.run([CONSOLE_SCRIPT, "init", "proj", "--data", "folder"], cwd=tmp_path,
                          capture_output=True).returncode == 0
    project = tmp_path / "proj"
    config = read_config(project)
    config["stages"]["energy"]["sharding"] = {"shard_size": 1}
    (project / "config/config.yaml").write_text(yaml.safe_dump(config))
    first = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local"], cwd=project,
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (project / "data/folder.jsonl").read_bytes()
    shutil.copy(DEMO_WAV / "cards-004.wav", folder / "spk1/c.wav")
    (folder / "aaa").mkdir()  # sorts before every other path
    shutil.copy(DEMO_WAV / "cards-005.wav", folder / "aaa/first.wav")
    again = subprocess.run([CONSOLE_SCRIPT, "manifest", "folder", "-o", "proj/data/folder.jsonl"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "note: 2 new file(s) after the 3 already in proj/data/folder.jsonl, which keep their order" in again.stderr
    after = (project / "data/folder.jsonl").read_bytes()
    assert after.startswith(before)
    assert [json.loads(line)["key"] for line in after[len(before):].decode().splitlines()] == ["aaa-first", "spk1-c"]
    dry = subprocess.run([sys.executable, "-m", "snakemake", "-n"], cwd=project, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert re.search(r"^shard_energy\s+2$", dry.stdout, re.M), dry.stdout  # the two new keys' shards, no other
    # a file removed: left out, said
    (folder / "spk1/b.wav").unlink()
    gone = subprocess.run([CONSOLE_SCRIPT, "manifest", "folder", "-o", "proj/data/folder.jsonl"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert "note: 1 key(s) of proj/data/folder.jsonl have no file any more: left out" in gone.stderr, gone.stderr
    assert len((project / "data/folder.jsonl").read_text().splitlines()) == 4
    (tmp_path / "notes.jsonl").write_text("just text\n")
    bad = subprocess.run([CONSOLE_SCRIPT, "manifest", "folder", "-o", "notes.jsonl"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and ("notes.jsonl:1: not a line of a manifest (a JSON object with a key): remove "
                                    "notes.jsonl to write it anew, or write to another file") in bad.stderr
    assert (tmp_path / "notes.jsonl").read_text() == "just text\n"  # not overwritten


def test_a_metadata_csv_saved_by_a_spreadsheet_with_a_byte_order_mark_reads(tmp_path):
    folder = speaker_folder(tmp_path)
    (folder / "metadata.csv").write_text("file_name,transcription\nspk1/a.wav,ten of clubs\n", encoding="utf-8-sig")
    made = subprocess.run([CONSOLE_SCRIPT, "manifest", str(folder), "-o", str(tmp_path / "m.jsonl")],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    first = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[1])
    assert first["key"] == "spk1-a" and first["transcription"] == "ten of clubs"
