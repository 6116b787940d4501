"""The digits recipe's data prep (``snakeshard.recipes.fsdd``) and ``snakeshard init --recipe digits``.

What a user relies on: the Kaldi dirs ``prepare`` writes (keys, absolute paths, labels, durations, which take or
speaker goes to which split), that a rerun rewrites nothing and added recordings are appended (old lines keep
their place), that bad recordings and bad ``fsdd:`` keys fail naming the file or key, that the download is checked
by ``fsdd.sha256`` and leaves nothing half-made, that the shipped checksum is the one of FSDD's recordings, and the
project ``init_recipe`` writes.

The inputs are a few of the Free Spoken Digit Dataset's real WAVs (a shared copy, linked or copied into tmp_path);
set SNAKESHARD_FSDD to another copy of its recordings/ directory. No network: the download tests fetch a
.tar.gz built here through a file:// URL.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import wave
from pathlib import Path

import pytest
import soundfile
import yaml

from snakeshard.errors import ConfigError, DataError
from snakeshard.recipes import fsdd, init_recipe
from snakeshard.recipes.fsdd import prepare, recordings_digest

REPO = Path(__file__).resolve().parents[1]
KALDI_FILES = ("wav.scp", "text", "utt2spk", "utt2dur")


@pytest.fixture(scope="module")
def shared() -> Path:
    """The shared copy of FSDD's recordings/ (3,000 WAVs)."""
    path = Path(os.environ.get("SNAKESHARD_FSDD", REPO / "../shared/data/fsdd/recordings")).resolve()
    if not path.is_dir() or not any(path.glob("*.wav")):
        pytest.skip(f"no FSDD recordings at {path}: set SNAKESHARD_FSDD to a copy of the dataset's recordings/ "
                    "directory (git clone https://github.com/Jakobovski/free-spoken-digit-dataset)")
    return path


def wav(digit: int, speaker: str, take: int) -> str:
    return f"{digit}_{speaker}_{take}.wav"


def key(digit: int, speaker: str, take: int) -> str:
    return f"{speaker}_{digit}_{take:02d}"


def subset(shared: Path, directory: Path, digits, speakers, takes, copy: bool = False) -> list[str]:
    """Link (or copy) the recordings digits x speakers x takes of ``shared`` into ``directory``; their names."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [wav(d, s, t) for d in digits for s in speakers for t in takes]
    for name in names:
        if copy:
            shutil.copyfile(shared / name, directory / name)
        else:
            (directory / name).symlink_to(shared / name)
    return names


def local(recordings: Path, data_dir: Path, **options) -> dict:
    """A config whose ``fsdd:`` section uses the local copy ``recordings``."""
    return {"fsdd": {"recordings": str(recordings), "data_dir": str(data_dir), **options}}


def pairs(path: Path) -> list[tuple[str, str]]:
    """The ``key value`` lines of a Kaldi file, in file order."""
    return [tuple(line.split(" ", 1)) for line in path.read_text().splitlines()]


def keys(directory: Path) -> list[str]:
    return [k for k, _ in pairs(directory / "wav.scp")]


def stamps(data_dir: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every file under ``data_dir``: a rewrite (a rename into place) changes the inode."""
    return {str(p.relative_to(data_dir)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(data_dir.rglob("*")) if p.is_file()}


# -- the take split: file contents ------------------------------------------------------------------------------

def test_take_split_writes_kaldi_dirs(shared, tmp_path, monkeypatch):
    recordings = tmp_path / "recordings"
    subset(shared, recordings, digits=(3, 7), speakers=("jackson", "theo"), takes=(0, 4, 5, 9, 10, 49), copy=True)
    # a file that is no .wav is not a recording: ignored
    (recordings / "README.md").write_text("notes\n")
    monkeypatch.chdir(tmp_path)

    dirs = prepare(local(Path("recordings"), tmp_path / "data"))  # relative: wav.scp still lists absolute paths

    assert dirs == {name: tmp_path / "data" / name for name in ("train", "valid", "test")}
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["test", "train", "valid"]
    takes = {"test": (0, 4), "valid": (5, 9), "train": (10, 49)}
    for name, split_takes in takes.items():
        directory = dirs[name]
        assert sorted(p.name for p in directory.iterdir()) == sorted(KALDI_FILES)
        expected = sorted(key(d, s, t) for d in (3, 7) for s in ("jackson", "theo") for t in split_takes)
        assert keys(directory) == expected  # a fresh dir is in sorted key order
        by_key = {k: (d, s, t) for d in (3, 7) for s in ("jackson", "theo") for t in split_takes
                  for k in [key(d, s, t)]}
        for k, path in pairs(directory / "wav.scp"):
            d, s, t = by_key[k]
            assert path == str((recordings / wav(d, s, t)).resolve()) and Path(path).is_absolute()
        assert pairs(directory / "text") == [(k, str(by_key[k][0])) for k in expected]
        assert pairs(directory / "utt2spk") == [(k, by_key[k][1]) for k in expected]
        for k, seconds in pairs(directory / "utt2dur"):
            path = recordings / wav(*by_key[k])
            with wave.open(str(path)) as w:  # the WAV header, read without soundfile
                assert w.getframerate() == 8000
                header = w.getnframes() / w.getframerate()
            info = soundfile.info(str(path))
            assert seconds == f"{header:.4f}" == f"{info.frames / info.samplerate:.4f}"
            assert 0.1 < float(seconds) < 3


def test_full_copy_split_counts(shared, tmp_path):
    by_take = prepare(local(shared, tmp_path / "takes"))
    assert {name: len(keys(d)) for name, d in by_take.items()} == {"train": 2400, "valid": 300, "test": 300}

    by_speaker = prepare(local(shared, tmp_path / "speakers", split="speakers", held_out_speaker="george"))
    assert {name: len(keys(d)) for name, d in by_speaker.items()} == {"train": 2250, "valid": 250, "test": 500}
    assert {s for _, s in pairs(by_speaker["test"] / "utt2spk")} == {"george"}


# -- the speakers split and config errors -----------------------------------------------------------------------

def test_speaker_split_holds_out_one_speaker(shared, tmp_path):
    recordings = tmp_path / "recordings"
    speakers = ("george", "jackson", "lucas")
    subset(shared, recordings, digits=(1, 6), speakers=speakers, takes=(0, 4, 5, 49))

    dirs = prepare(local(recordings, tmp_path / "data", split="speakers", held_out_speaker="lucas"))

    others = ("george", "jackson")
    assert keys(dirs["test"]) == sorted(key(d, "lucas", t) for d in (1, 6) for t in (0, 4, 5, 49))
    assert keys(dirs["valid"]) == sorted(key(d, s, t) for d in (1, 6) for s in others for t in (0, 4))
    assert keys(dirs["train"]) == sorted(key(d, s, t) for d in (1, 6) for s in others for t in (5, 49))
    assert {s for _, s in pairs(dirs["test"] / "utt2spk")} == {"lucas"}


@pytest.mark.parametrize("options, error, fragments", [
    ({"split": "speakers", "held_out_speaker": "nobody"}, ConfigError,
     ["fsdd.held_out_speaker", "'nobody'", "george, jackson, lucas"]),
    ({"split": "speakers"}, ConfigError, ["fsdd.held_out_speaker", "george, jackson, lucas"]),
    ({"split": "random"}, ConfigError, ["fsdd.split", "'random'", "'takes' or 'speakers'"]),
    ({"held_out": "george"}, ConfigError, ["fsdd.held_out: unknown key", "held_out_speaker"]),
], ids=["unknown-speaker", "no-speaker", "unknown-split", "unknown-key"])
def test_bad_split_options_fail_naming_the_key(shared, tmp_path, options, error, fragments):
    recordings = tmp_path / "recordings"
    subset(shared, recordings, digits=(1,), speakers=("george", "jackson", "lucas"), takes=(0, 5))
    with pytest.raises(error) as e:
        prepare(local(recordings, tmp_path / "data", **options))
    for fragment in fragments:
        assert fragment in str(e.value)
    assert not (tmp_path / "data").exists()  # refused before any data dir is written


# -- reruns and appended recordings -----------------------------------------------------------------------------

def test_rerun_rewrites_nothing(shared, tmp_path):
    recordings = tmp_path / "recordings"
    subset(shared, recordings, digits=(0, 9), speakers=("nicolas", "yweweler"), takes=(1, 7, 30))
    data = tmp_path / "data"
    prepare(local(recordings, data))
    old = 1_000_000_000_000_000_000  # an mtime in 2001: any rewrite would set a newer one
    for path in data.rglob("*"):
        if path.is_file():
            os.utime(path, ns=(old, old))
    before = stamps(data)
    assert len(before) == 12

    prepare(local(recordings, data))

    assert stamps(data) == before


def test_added_recordings_are_appended(shared, tmp_path):
    recordings, data = tmp_path / "recordings", tmp_path / "data"
    digits, speakers = (2, 8), ("jackson", "theo")
    subset(shared, recordings, digits, speakers, takes=range(45))
    prepare(local(recordings, data))
    first = {name: {f: pairs(data / name / f) for f in KALDI_FILES} for name in ("train", "valid", "test")}
    eval_stamps = {k: v for k, v in stamps(data).items() if not k.startswith("train")}

    subset(shared, recordings, digits, speakers, takes=range(45, 50))
    prepare(local(recordings, data))

    new_keys = sorted(key(d, s, t) for d in digits for s in speakers for t in range(45, 50))
    for f in KALDI_FILES:
        lines = pairs(data / "train" / f)
        assert lines[:len(first["train"][f])] == first["train"][f]  # the old lines, in their old order
        assert [k for k, _ in lines[len(first["train"][f]):]] == new_keys  # then the new keys, sorted
    assert keys(data / "train") != sorted(keys(data / "train"))  # appended, not re-sorted
    assert {k: v for k, v in stamps(data).items() if not k.startswith("train")} == eval_stamps  # untouched

    # a removed recording's line goes; every other line keeps its place
    gone = [wav(8, "jackson", 20), wav(2, "theo", 47)]
    for name in gone:
        (recordings / name).unlink()
    before = {f: pairs(data / "train" / f) for f in KALDI_FILES}
    prepare(local(recordings, data))
    for f in KALDI_FILES:
        assert pairs(data / "train" / f) == [p for p in before[f] if p[0] not in {"jackson_8_20", "theo_2_47"}]
    assert len(keys(data / "train")) == 2 * 2 * 40 - 2


# -- bad recordings ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["seven_jackson_1.wav", "7_jackson.wav", "7_Jackson_1.wav"])
def test_misnamed_wav_fails_naming_it(shared, tmp_path, name):
    recordings = tmp_path / "recordings"
    subset(shared, recordings, digits=(7,), speakers=("jackson",), takes=(0, 10))
    shutil.copyfile(shared / wav(7, "jackson", 1), recordings / name)  # real audio, a name with no label
    with pytest.raises(DataError) as e:
        prepare(local(recordings, tmp_path / "data"))
    assert str(recordings / name) in str(e.value) and "not an FSDD name" in str(e.value)
    assert not (tmp_path / "data").exists()


def test_two_names_of_one_key_fail(shared, tmp_path):
    recordings = tmp_path / "recordings"
    subset(shared, recordings, digits=(7,), speakers=("jackson",), takes=(1, 10))
    shutil.copyfile(shared / wav(7, "jackson", 2), recordings / "7_jackson_01.wav")  # key jackson_7_01 again
    with pytest.raises(DataError) as e:
        prepare(local(recordings, tmp_path / "data"))
    message = str(e.value)
    assert "jackson_7_01" in message and "7_jackson_01.wav" in message and "7_jackson_1.wav" in message
    assert not (tmp_path / "data").exists()


def test_non_audio_wav_fails_naming_it(shared, tmp_path):
    recordings = tmp_path / "recordings"
    subset(shared, recordings, digits=(0,), speakers=("george",), takes=(0, 10))
    (recordings / "0_x_1.wav").write_text("not audio\n")
    with pytest.raises(DataError) as e:
        prepare(local(recordings, tmp_path / "data"))
    assert str(recordings / "0_x_1.wav") in str(e.value) and "not readable as audio" in str(e.value)
    assert not (tmp_path / "data").exists()


def test_empty_recordings_dir_fails(tmp_path):
    recordings = tmp_path / "recordings"
    recordings.mkdir()
    (recordings / "README.md").write_text("no audio here\n")
    with pytest.raises(DataError) as e:
        prepare(local(recordings, tmp_path / "data"))
    assert str(recordings) in str(e.value) and "no .wav files" in str(e.value)
    assert not (tmp_path / "data").exists()


def test_missing_recordings_dir_fails_naming_the_key(tmp_path):
    missing = tmp_path / "nowhere" / "recordings"
    with pytest.raises(ConfigError) as e:
        prepare(local(missing, tmp_path / "data"))
    assert str(e.value).startswith("fsdd.recordings: ") and str(missing) in str(e.value)
    assert not (tmp_path / "downloads").exists() and not (tmp_path / "data").exists()


def test_a_recipe_without_data_where_nothing_downloads_ends_with_one_error_line(tmp_path):
    """`snakeshard init --recipe digits` without --data, where the release cannot be fetched (no network): the
    parse ends with the download's one `snakeshard: error:` line naming fsdd.url and --data, no traceback (it
    printed Snakemake's "DataError in file .../Snakefile" and the frames of fsdd.py), and leaves no data dir."""
    wd = tmp_path / "digits"
    init_recipe("digits", wd)
    config = wd / "config/config.yaml"
    url = (tmp_path / "nowhere.tar.gz").as_uri()  # fails as an unreachable host does: an OSError from urlretrieve
    config.write_text(config.read_text().replace("  split: takes", f"  url: {url}\n  split: takes", 1))
    run = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local", "-n"], cwd=wd,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("snakeshard: error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"snakeshard: error: fsdd.url: could not download {url}: "), \
        run.stderr[-3000:]
    assert "--data PATH" in errors[0]
    assert "Traceback" not in run.stderr and "DataError" not in run.stderr, run.stderr[-3000:]
    assert not (wd / "data").exists()


# -- the download (a file:// URL: no network) -------------------------------------------------------------------

PREFIX = "free-spoken-digit-dataset-1.0.10"


@pytest.fixture
def release(shared, tmp_path) -> tuple[Path, list[str], str]:
    """A .tar.gz laid out as FSDD's tagged release, holding a few recordings: (archive, their names, digest)."""
    names = [wav(d, s, t) for d in (4, 5) for s in ("lucas", "theo") for t in (0, 6, 33)]
    tree = tmp_path / "tree" / PREFIX
    (tree / "recordings").mkdir(parents=True)
    (tree / "acoustic").mkdir()
    for name in names:
        shutil.copyfile(shared / name, tree / "recordings" / name)
    (tree / "README.md").write_text("FSDD\n")
    (tree / "recordings" / "notes.txt").write_text("not a recording\n")
    shutil.copyfile(shared / names[0], tree / "acoustic" / "4_lucas_99.wav")  # a .wav outside recordings/
    archive = tmp_path / "fsdd.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname=PREFIX)
    return archive, names, recordings_digest([tree / "recordings" / name for name in names])


def remote(url: str, sha256: str, tmp_path: Path) -> dict:
    return {"fsdd": {"url": url, "sha256": sha256, "download_dir": str(tmp_path / "downloads"),
                     "data_dir": str(tmp_path / "data")}}


def temp_dirs(download_dir: Path) -> list[Path]:
    return list(download_dir.glob(".fsdd.*"))


def test_download_once_into_download_dir(release, shared, tmp_path, capsys):
    archive, names, digest = release
    config = remote("file://" + str(archive), digest, tmp_path)
    target = tmp_path / "downloads" / "recordings"

    dirs = prepare(config)

    assert "downloading file://" in capsys.readouterr().err
    assert sorted(p.name for p in target.iterdir()) == sorted(names)  # only recordings/*.wav
    for name in names:
        assert (target / name).read_bytes() == (shared / name).read_bytes()
    assert temp_dirs(tmp_path / "downloads") == []
    assert keys(dirs["test"]) == sorted(key(d, s, 0) for d in (4, 5) for s in ("lucas", "theo"))
    assert {Path(p).parent for _, p in pairs(dirs["train"] / "wav.scp")} == {target.resolve()}
    before = stamps(tmp_path / "data")

    archive.unlink()  # a second run uses the download: no fetch
    assert prepare(config) == dirs
    assert "downloading" not in capsys.readouterr().err
    assert stamps(tmp_path / "data") == before


def test_wrong_sha256_fails_and_leaves_nothing(release, tmp_path):
    archive, _, digest = release
    wrong = "0" * 64
    with pytest.raises(DataError) as e:
        prepare(remote("file://" + str(archive), wrong, tmp_path))
    message = str(e.value)
    assert message.startswith("fsdd.sha256: ") and digest in message and wrong in message
    assert not (tmp_path / "downloads" / "recordings").exists()
    assert temp_dirs(tmp_path / "downloads") == []
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("damage", ["truncated", "html-page"])
def test_damaged_archive_fails_naming_the_url(release, tmp_path, damage):
    archive, _, digest = release
    data = archive.read_bytes()
    archive.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"<html>rate limited</html>\n")
    url = "file://" + str(archive)
    with pytest.raises(DataError) as e:
        prepare(remote(url, digest, tmp_path))
    assert str(e.value).startswith(f"fsdd.url: {url} gave no whole .tar.gz")
    assert not (tmp_path / "downloads" / "recordings").exists()
    assert temp_dirs(tmp_path / "downloads") == []


def test_unreachable_url_fails_naming_the_key_and_data_option(tmp_path):
    url = "file://" + str(tmp_path / "missing.tar.gz")
    with pytest.raises(DataError) as e:
        prepare(remote(url, fsdd.SHA256, tmp_path))
    message = str(e.value)
    assert message.startswith("fsdd.url: ") and url in message and "--data" in message
    assert not (tmp_path / "downloads" / "recordings").exists()
    assert temp_dirs(tmp_path / "downloads") == []


def test_stale_temp_dir_is_removed_by_the_next_download(release, tmp_path):
    archive, names, digest = release
    stale = tmp_path / "downloads" / ".fsdd.xyz"
    (stale / "recordings").mkdir(parents=True)
    (stale / "fsdd.tar.gz").write_bytes(b"\x1f\x8b half an archive")  # what a killed download leaves

    prepare(remote("file://" + str(archive), digest, tmp_path))

    assert not stale.exists() and temp_dirs(tmp_path / "downloads") == []
    assert len(list((tmp_path / "downloads" / "recordings").glob("*.wav"))) == len(names)


# -- the shipped checksum ---------------------------------------------------------------------------------------

def test_shipped_sha256_is_the_digest_of_the_recordings(shared):
    files = list(shared.glob("*.wav"))
    assert len(files) == 3000
    assert recordings_digest(files) == fsdd.SHA256


# -- snakeshard init --recipe digits ----------------------------------------------------------------------------

def test_init_recipe_writes_config_with_absolute_quoted_recordings(shared, tmp_path, monkeypatch):
    # a name YAML would misread unquoted (': ' and ' #'), given relative to the working directory
    data = tmp_path / "fsdd: copy #1"
    subset(shared, data, digits=(3,), speakers=("george", "theo"), takes=(0, 5, 20))
    monkeypatch.chdir(tmp_path)

    written = init_recipe("digits", "project", data.name)

    project = tmp_path / "project"
    assert written[:2] == ["Snakefile", "config/config.yaml"]
    assert all((project / path).is_file() for path in written)
    text = (project / "config/config.yaml").read_text()
    assert f'recordings: "{data}"' in text
    config = yaml.safe_load(text)
    assert config["fsdd"]["recordings"] == str(data)

    # the recipe's own fsdd: section is one prepare() takes, run from the project as its Snakefile does
    monkeypatch.chdir(project)
    dirs = prepare(config)
    assert keys(dirs["train"]) == ["george_3_20", "theo_3_20"]
    assert (project / "data/takes/test/wav.scp").is_file()


def test_init_recipe_without_data_downloads(tmp_path):
    init_recipe("digits", tmp_path / "project")
    config = yaml.safe_load((tmp_path / "project/config/config.yaml").read_text())
    assert "recordings: null" in (tmp_path / "project/config/config.yaml").read_text()
    assert config["fsdd"]["recordings"] is None


def test_init_recipe_refuses_an_existing_project_file(tmp_path):
    project = tmp_path / "project"
    (project / "config").mkdir(parents=True)
    (project / "config/config.yaml").write_text("mine\n")
    with pytest.raises(ConfigError) as e:
        init_recipe("digits", project)
    assert "config/config.yaml" in str(e.value) and "not overwriting" in str(e.value)
    assert (project / "config/config.yaml").read_text() == "mine\n"
    assert sorted(p.name for p in project.iterdir()) == ["config"]  # nothing else written


@pytest.mark.parametrize("kind", ["empty-dir", "missing", "a-file"])
def test_init_recipe_refuses_data_without_wavs(tmp_path, kind):
    data = tmp_path / "data"
    if kind == "empty-dir":
        data.mkdir()
    elif kind == "a-file":
        data.write_text("0_george_0.wav\n")
    with pytest.raises(ConfigError) as e:
        init_recipe("digits", tmp_path / "project", str(data))
    assert str(e.value).startswith(f"--data {data}: ")
    assert not (tmp_path / "project").exists()


def test_init_recipe_refuses_an_unknown_recipe(tmp_path):
    with pytest.raises(ConfigError) as e:
        init_recipe("letters", tmp_path / "project")
    assert "'letters'" in str(e.value) and "digits" in str(e.value)
    assert not (tmp_path / "project").exists()


def test_cli_init_recipe(shared, tmp_path):
    data = tmp_path / "recordings"
    subset(shared, data, digits=(1,), speakers=("george",), takes=(0,))

    def init():
        return subprocess.run([sys.executable, "-m", "snakeshard", "init", "--recipe", "digits", "proj",
                               "--data", str(data)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              check=False)

    run = init()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("wrote Snakefile, config/config.yaml, ") and lines[0].endswith(" in proj")
    assert lines[1] == "next: cd proj && snakemake --profile profiles/local"
    assert yaml.safe_load((tmp_path / "proj/config/config.yaml").read_text())["fsdd"]["recordings"] == str(data)

    again = init()  # a second init into the same directory: one line naming what it would overwrite
    assert again.returncode != 0
    assert again.stderr.startswith("snakeshard: error: proj already has Snakefile")
    assert "Traceback" not in again.stderr
