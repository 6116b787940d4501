"""The Free Spoken Digit Dataset (FSDD) for the digits recipe: fetch it, check it, write Kaldi data dirs.

FSDD (https://github.com/Jakobovski/free-spoken-digit-dataset, CC BY-SA 4.0) holds ``recordings/
{digit}_{speaker}_{take}.wav``: 8 kHz mono, 6 speakers x 10 digits x 50 takes at tag v1.0.10.

``prepare(config)`` runs while the recipe's Snakefile is parsed (the shard plan is made at parse time, so the data
dirs must exist before it): it finds the recordings (a local copy, ``fsdd.recordings``, or the tagged release,
downloaded once into ``fsdd.download_dir`` and checked against ``fsdd.sha256``), then writes ``train``, ``valid``
and ``test`` Kaldi dirs (wav.scp, text = the digit, utt2spk, utt2dur) under ``fsdd.data_dir``. Each file is
rewritten only when its content changes, so a second run plans nothing new; keys already listed keep their
place and new recordings are appended, so adding recordings changes only the shards that get them.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.request
import zlib
from pathlib import Path

from snakeshard.errors import ConfigError, DataError
from snakeshard.io.atomic import write_if_changed

URL = "https://github.com/Jakobovski/free-spoken-digit-dataset/archive/refs/tags/v1.0.10.tar.gz"
# recordings_digest() of v1.0.10's recordings/ (3,000 files; the same tree as commit 26eb9aa)
SHA256 = "dbd573d7cafe79c4b49f65718115e1304e24e067fa39eff18a660dc6cb9c360f"
NAME = re.compile(r"(?P<digit>[0-9])_(?P<speaker>[a-z]+)_(?P<take>[0-9]+)\.wav")
SPLITS = ("train", "valid", "test")
VALID_TAKES, TEST_TAKES = range(5, 10), range(5)  # the take split; the rest (10-49) trains
DEFAULTS = {"recordings": None, "url": URL, "sha256": SHA256, "download_dir": "downloads", "data_dir": "data",
            "split": "takes", "held_out_speaker": None}


def prepare(config: dict) -> dict[str, Path]:
    """Data prep from the config's ``fsdd:`` section; returns {split: data dir}. See the module docstring."""
    fsdd = {**DEFAULTS, **(config.get("fsdd") or {})}
    unknown = sorted(set(fsdd) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"fsdd.{unknown[0]}: unknown key; known: {sorted(DEFAULTS)}")
    if fsdd["recordings"]:
        recordings = Path(fsdd["recordings"])
        if not recordings.is_dir():
            raise ConfigError(f"fsdd.recordings: {recordings} is no directory (relative to {os.getcwd()}); give "
                              "FSDD's recordings/ directory, or leave fsdd.recordings unset to download it")
    else:
        recordings = download(fsdd["url"], fsdd["sha256"], Path(fsdd["download_dir"]))
    utterances = scan(recordings)
    splits = split(utterances, fsdd["split"], fsdd["held_out_speaker"])
    return {name: write_kaldi_dir(Path(fsdd["data_dir"]) / name, members) for name, members in splits.items()}


def scan(recordings: Path) -> list[dict]:
    """One record per ``{digit}_{speaker}_{take}.wav`` in ``recordings``: key, path, digit, speaker, take, seconds.
    Any other .wav is an error naming it (a misnamed file would get no label)."""
    import soundfile

    found, seen = [], {}
    for path in sorted(recordings.glob("*.wav")):
        m = NAME.fullmatch(path.name)
        if m is None:
            raise DataError(f"{path}: not an FSDD name ({{digit}}_{{speaker}}_{{take}}.wav, e.g. 7_jackson_32.wav)")
        try:
            info = soundfile.info(str(path))
        except RuntimeError as e:
            raise DataError(f"{path}: not readable as audio: {e}") from e
        # Kaldi's convention: an utterance id starts with its speaker id
        key = f"{m['speaker']}_{m['digit']}_{int(m['take']):02d}"
        # 7_jackson_1.wav and 7_jackson_01.wav give one key: write_kaldi_dir would keep one and drop the other
        # without a word (found by test_recipe_fsdd's test_two_names_of_one_key_fail)
        if key in seen:
            raise DataError(f"{path}: the same utterance key ({key}) as {seen[key]}; rename or remove one")
        seen[key] = path
        found.append({"key": key, "path": str(path.resolve()), "digit": m["digit"], "speaker": m["speaker"],
                      "take": int(m["take"]), "seconds": info.frames / info.samplerate})
    if not found:
        raise DataError(f"{recordings}: no .wav files (FSDD's recordings/ holds 3,000)")
    return found


def split(utterances: list[dict], how: str, held_out_speaker: str | None) -> dict[str, list[dict]]:
    """``takes``: train takes 10-49, valid 5-9, test 0-4 of every speaker (FSDD's usual test set is takes 0-4).
    ``speakers``: test is every take of ``held_out_speaker``; valid takes 0-4 and train takes 5-49 of the others."""
    if how == "takes":
        def which(u):
            return "test" if u["take"] in TEST_TAKES else "valid" if u["take"] in VALID_TAKES else "train"
    elif how == "speakers":
        speakers = sorted({u["speaker"] for u in utterances})
        if held_out_speaker not in speakers:
            raise ConfigError(f"fsdd.held_out_speaker: {held_out_speaker!r} is none of the speakers found "
                              f"({', '.join(speakers)})")

        def which(u):
            return "test" if u["speaker"] == held_out_speaker else "valid" if u["take"] in TEST_TAKES else "train"
    else:
        raise ConfigError(f"fsdd.split: {how!r}; 'takes' or 'speakers'")
    out = {name: [] for name in SPLITS}
    for u in utterances:
        out[which(u)].append(u)
    return out


def write_kaldi_dir(directory: Path, members: list[dict]) -> Path:
    """wav.scp, text, utt2spk, utt2dur of ``members``. Keys the existing wav.scp lists keep their order; new ones
    follow, sorted: appended recordings land in new shards, not in every shard after them."""
    by_key = {u["key"]: u for u in members}
    previous = []
    if (directory / "wav.scp").exists():
        previous = [line.split(maxsplit=1)[0] for line in (directory / "wav.scp").read_text().splitlines() if line]
    order = [k for k in previous if k in by_key]
    kept = set(order)
    order += sorted(k for k in by_key if k not in kept)
    columns = {"wav.scp": lambda u: u["path"], "text": lambda u: u["digit"], "utt2spk": lambda u: u["speaker"],
               "utt2dur": lambda u: f"{u['seconds']:.4f}"}
    for name, column in columns.items():
        write_if_changed(directory / name, "".join(f"{k} {column(by_key[k])}\n" for k in order))
    return directory


def recordings_digest(files: list[Path]) -> str:
    """sha256 of the lines ``<file name> <sha256 of its bytes>``, sorted by name: the same for any copy of the
    same recordings, however the archive holding them was compressed."""
    lines = []
    for path in sorted(files, key=lambda p: p.name):
        lines.append(f"{path.name} {hashlib.sha256(path.read_bytes()).hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def download(url: str, sha256: str, download_dir: Path) -> Path:
    """``download_dir/recordings``: there already (checked when it was made), else fetched from ``url`` (a
    .tar.gz holding ``*/recordings/*.wav``), checked against ``sha256`` and renamed into place."""
    target = download_dir / "recordings"
    if target.is_dir():
        return target
    download_dir.mkdir(parents=True, exist_ok=True)
    for stale in download_dir.glob(".fsdd.*"):  # a killed download's temp dir
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=download_dir, prefix=".fsdd.") as tmp:
        archive = Path(tmp) / "fsdd.tar.gz"
        print(f"downloading {url} (about 16 MB) ...", file=sys.stderr, flush=True)
        try:
            urllib.request.urlretrieve(url, archive)
        except OSError as e:
            raise DataError(f"fsdd.url: could not download {url}: {e}; without a network, give a local copy of "
                            "FSDD's recordings/ (snakeshard init --recipe digits DIR --data PATH, or "
                            "fsdd.recordings in config/config.yaml)") from e
        extracted = Path(tmp) / "recordings"
        extracted.mkdir()
        # a truncated download or an HTML page was a traceback (tarfile.ReadError, EOFError) naming no config key
        # (found by test_recipe_fsdd's test_damaged_archive_fails_naming_the_url)
        try:
            with tarfile.open(archive) as tar:
                for member in tar.getmembers():
                    parts = Path(member.name).parts
                    if (member.isfile() and len(parts) >= 2 and parts[-2] == "recordings"
                            and member.name.endswith(".wav")):
                        with tar.extractfile(member) as src, open(extracted / parts[-1], "wb") as dst:
                            shutil.copyfileobj(src, dst)
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise DataError(f"fsdd.url: {url} gave no whole .tar.gz ({why}): a damaged download, or not FSDD's "
                            "release archive; run again, or give a local copy of FSDD's recordings/ "
                            "(fsdd.recordings in config/config.yaml)") from e
        got = recordings_digest(list(extracted.glob("*.wav")))
        if got != sha256:
            raise DataError(f"fsdd.sha256: the recordings of {url} have digest {got}, the config expects {sha256}: "
                            "not using them (a changed upstream release, or a damaged download)")
        extracted.rename(target)  # whole or absent: a kill before this leaves only the temp dir, removed next time
    return target
