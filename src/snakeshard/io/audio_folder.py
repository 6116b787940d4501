"""A folder of audio files as a JSON Lines manifest (``snakeshard manifest FOLDER``, ``snakeshard init --data FOLDER``).

Data that is not a Kaldi dir is most often a folder of files, maybe in speaker subfolders, with a table of
transcripts beside it: Hugging Face's "audiofolder" layout puts a ``metadata.csv`` (or ``metadata.jsonl``) at the
folder's top whose ``file_name`` column names each file relative to it. The manifest holds one line per audio
file, in sorted path order (a speaker's files together, as ``keep_together`` needs): ``key``, ``audio`` (the
absolute path), ``duration`` (seconds, from the header, so that shards can be cut by seconds without reading
headers at every plan), ``dir`` (the subfolder it is in, e.g. its speaker's or its class's: a field that
``keep_together``, a scoring stage's ``group_by`` or a training stage's ``labels`` can name; left out for a file at
the top) and the file's metadata columns (a ``dir`` column among them wins).

The key is the file's path under the folder without its suffix, ``/`` as ``-`` and whitespace as ``_``
(``spk1/utt 01.flac`` -> ``spk1-utt_01``): a key names output files (``<field>/<key>.wav``) and Kaldi lines, which
hold neither. Two files that make the same key are refused, naming both.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path, PurePosixPath

from snakeshard.errors import AudioError, DataError

# What libsndfile (soundfile) reads that a speech folder holds; other files (texts, images) are not audio.
AUDIO_SUFFIXES = frozenset({".wav", ".flac", ".ogg", ".opus", ".mp3", ".aif", ".aiff", ".au", ".caf", ".w64",
                            ".rf64", ".sph"})
METADATA = ("metadata.csv", "metadata.jsonl")  # Hugging Face audiofolder's names, at the folder's top
OWN_FIELDS = ("key", "audio", "duration")
MAX_SHOWN = 5  # files named in one message or note


def audio_files(folder: Path) -> list[Path]:
    """The audio files under ``folder`` (its subfolders too, symlinks followed), sorted by path."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in files if Path(f).suffix.lower() in AUDIO_SUFFIXES and not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def key_of(relative: str) -> str:
    """The key of a file at ``relative`` (a posix path under the folder, with its audio suffix)."""
    return re.sub(r"\s+", "_", str(PurePosixPath(relative).with_suffix("")).replace("/", "-"))


def read_metadata(folder: Path) -> tuple[dict[str, dict], Path | None]:
    """{file_name: its other columns} from the folder's metadata.csv or metadata.jsonl, and the file read."""
    found = [folder / name for name in METADATA if (folder / name).is_file()]
    if len(found) > 1:
        raise DataError(f"{folder} holds both {found[0].name} and {found[1].name}: keep one")
    if not found:
        return {}, None
    path = found[0]
    # utf-8-sig: a CSV saved by a spreadsheet starts with a byte order mark, which would join the first column's name
    with open(path, encoding="utf-8-sig", newline="") as f:
        if path.suffix == ".csv":
            rows = list(csv.DictReader(f))
            where = [f"{path}:{n}" for n in range(2, len(rows) + 2)]  # line 1 is the header
        else:
            rows, where = [], []
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except ValueError as e:
                        raise DataError(f"{path}:{n}: not a JSON object: {e}") from None
                    where.append(f"{path}:{n}")
    table: dict[str, dict] = {}
    for row, at in zip(rows, where):
        if not isinstance(row, dict) or not row.get("file_name"):
            raise DataError(f"{at}: no file_name (the column that names each audio file, relative to {folder})")
        if None in row:  # csv's name for the values past the header's columns
            raise DataError(f"{at}: more values than the header has columns ({len(row) - 1}): quote a value that "
                            "holds a comma")
        clash = [c for c in OWN_FIELDS if c in row]
        if clash:
            raise DataError(f"{at}: column {clash[0]!r} is a field the manifest writes itself ({', '.join(OWN_FIELDS)});"
                            " rename it")
        name = Path(row["file_name"]).as_posix()
        if name in table:
            raise DataError(f"{at}: file_name {name!r} again (an earlier row names it too)")
        table[name] = {c: v for c, v in row.items() if c != "file_name"}
    return table, path


def folder_manifest(folder: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """(one record per audio file under ``folder``, notes for the user: files at a rarer sample rate or of several
    channels, metadata rows without a file, files without a row). Raises naming the folder when it holds no audio,
    both files of a key made twice, and every file that does not read."""
    from snakeshard.io.audio import audio_header

    folder = Path(folder).resolve()
    files = audio_files(folder)
    if not files:
        raise DataError(f"{folder}: no audio file in it or its subfolders (looked for "
                        f"{', '.join(sorted(AUDIO_SUFFIXES))})")
    table, metadata = read_metadata(folder)
    records, first_of_key, unreadable = [], {}, []
    rates: dict[int, list[str]] = {}  # sample rate: files
    channels: list[str] = []  # files of more than one channel
    for path in files:
        relative = path.relative_to(folder).as_posix()
        key = key_of(relative)
        if key in first_of_key:
            raise DataError(f"{folder}: {first_of_key[key]} and {relative} both make key {key!r} (a key is the path "
                            "without its suffix): rename one")
        first_of_key[key] = relative
        try:
            info = audio_header(str(path), relative)
        except AudioError as e:  # every bad file at once, not one per try
            unreadable.append(str(e))
            continue
        if info.frames == 0:
            unreadable.append(f"{relative}: holds no samples (0 frames)")
            continue
        rates.setdefault(info.samplerate, []).append(relative)
        if info.channels > 1:
            channels.append(relative)
        parent = PurePosixPath(relative).parent.as_posix()
        records.append({"key": key, "audio": str(path), "duration": round(info.duration, 6),
                        **({"dir": parent} if parent != "." else {}), **table.get(relative, {})})
    if unreadable:
        raise DataError(f"{folder}: {len(unreadable)} of {len(files)} audio files do not read (fix or remove them, "
                        f"then run this again): " + "; ".join(unreadable[:MAX_SHOWN])
                        + (f"; ... {len(unreadable) - MAX_SHOWN} more" if len(unreadable) > MAX_SHOWN else ""))
    # said now, not when a stage's job meets them: a stage reads one rate and one channel (a user's trial)
    notes = []
    if len(rates) > 1:
        common = max(rates, key=lambda r: len(rates[r]))
        for rate, names in sorted(rates.items()):
            if rate != common:
                notes.append(f"{len(names)} file(s) at {rate} Hz, the others at {common} Hz (a stage reads one rate: "
                             f"resample them, e.g. sox -D IN -r {common} OUT): {_listed(names)}")
    if channels:
        notes.append(f"{len(channels)} file(s) of more than one channel (a stage reads one: downmix them, e.g. sox IN "
                     f"-c 1 OUT): {_listed(channels)}")
    if metadata is not None:
        unmatched = sorted(set(table) - set(first_of_key.values()))
        without = [r for r in first_of_key.values() if r not in table]
        if unmatched:
            notes.append(f"{metadata}: {len(unmatched)} row(s) name no audio file here, left out: {_listed(unmatched)}")
        if without:
            notes.append(f"{metadata}: no row for {len(without)} audio file(s), which get no metadata fields: "
                         f"{_listed(without)}")
    return records, notes


def _listed(names: list[str]) -> str:
    return ", ".join(names[:MAX_SHOWN]) + (" ..." if len(names) > MAX_SHOWN else "")


def write_records(records: list[dict], out: str | os.PathLike) -> None:
    """The manifest's lines, written whole (by rename): a killed write leaves no half manifest to plan from."""
    from snakeshard.io.atomic import atomic_write_text

    atomic_write_text(Path(out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def manifest_summary(records: list[dict], folder: str | os.PathLike, out: str | os.PathLike) -> str:
    """``<out>: N audio files of <folder>, S s; fields from its metadata: ...``."""
    fields = sorted({c for r in records for c in r} - set(OWN_FIELDS) - {"dir"})
    dirs = len({r["dir"] for r in records if "dir" in r})
    return (f"{out}: {len(records)} audio files of {Path(folder).resolve()}, "
            f"{sum(r['duration'] for r in records):.1f} s"
            + (f", in {dirs} subfolder{'s' if dirs > 1 else ''} (field dir)" if dirs else "")
            + (f"; fields from its metadata: {', '.join(fields)}" if fields else ""))


def in_previous_order(records: list[dict], previous: Path) -> tuple[list[dict], list[str]]:
    """``records`` in the order of the manifest they replace: the keys it has first, as they were, then the new
    ones (sorted). When files were only added, the old manifest is then the new one's first lines: the plan reads
    only the new lines, and ``shard_size``/``shard_seconds`` keep every shard before them (a folder's rerun after
    new recordings redoes their shards only)."""
    old: dict[str, int] = {}  # key: its line's place
    with open(previous, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                key = json.loads(line)["key"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{previous}:{n}: not a line of a manifest (a JSON object with a key): remove "
                                f"{previous} to write it anew, or write to another file") from None
            old.setdefault(key, len(old))
    kept = sorted((r for r in records if r["key"] in old), key=lambda r: old[r["key"]])
    added = [r for r in records if r["key"] not in old]
    notes = []
    if added:
        notes.append(f"{len(added)} new file(s) after the {len(kept)} already in {previous}, which keep their order")
    if len(kept) < len(old):
        notes.append(f"{len(old) - len(kept)} key(s) of {previous} have no file any more: left out")
    return kept + added, notes


def write_manifest(folder: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Write ``folder``'s manifest to ``out`` (in the order of the manifest already there: in_previous_order);
    returns lines for the user (what it holds, then notes)."""
    records, notes = folder_manifest(folder)
    if Path(out).exists():
        records, kept = in_previous_order(records, Path(out))
        notes = kept + notes
    write_records(records, out)
    return [manifest_summary(records, folder, out)] + [f"note: {n}" for n in notes]
