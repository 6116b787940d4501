"""``snakeshard init DIR``: a new project that uses the shipped workflow as a Snakemake module.

It writes ``Snakefile`` (the module directive, room for the user's own rules),
``config/config.yaml`` (one stage over the chosen data), ``my_stage.py`` (a runnable
runner and provider) and ``profiles/local`` + ``profiles/slurm``. Without ``--data``
it copies the demo speech that ships with snakeshard into ``data/demo``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

from snakeshard.core.data import is_pipe
from snakeshard.errors import ConfigError
from snakeshard.resources import PACKAGE_DIR, demo_data_dir, profiles_dir

TEMPLATE_DIR = PACKAGE_DIR / "project_template"
WRITTEN = ("Snakefile", "config/config.yaml", "my_stage.py", "profiles/local/config.yaml",
           "profiles/slurm/config.yaml")


def init_project(directory: str | os.PathLike, data: str | None = None) -> tuple[list[str], list[str]]:
    """Write a new project into ``directory`` (created if missing); returns the files written, and lines for the
    user about the data (a folder's manifest: what it holds, and metadata rows and files that did not match).

    Refuses to overwrite any file it would write. ``data`` is a Kaldi data dir, a ``.jsonl`` manifest, or a
    folder of audio files (its manifest is written to ``data/<folder name>.jsonl``, see io.audio_folder); relative
    to the current directory, stored relative to the project when inside it.
    """
    root = Path(directory)
    clashes = [name for name in WRITTEN if (root / name).exists()]
    if clashes:
        raise ConfigError(f"{root} already has {', '.join(clashes)}: not overwriting (choose an empty directory)")
    said: list[str] = []
    records = None  # a folder's manifest lines
    if data is None:
        name, path, fmt = "demo", "data/demo", "kaldi"
        if (root / path).exists():
            raise ConfigError(f"{root / path} already exists: not overwriting (or pass --data {root / path})")
    else:
        name, path, fmt = _describe_data(Path(data), root)
        if fmt == "folder":  # its manifest, written into the project, is the dataset
            from snakeshard.io.audio_folder import folder_manifest, manifest_summary

            path, fmt = f"data/{name}.jsonl", "jsonl"
            if (root / path).exists():
                raise ConfigError(f"{root / path} already exists: not overwriting (or pass --data {root / path})")
            records, notes = folder_manifest(data)  # before anything is written: a bad folder leaves no project
            said = [manifest_summary(records, data, path)] + [f"note: {n}" for n in notes] + [
                f"files added to {data} later: snakeshard manifest {shlex.quote(str(Path(data).resolve()))} -o "
                f"{path} (run in {directory}; they are appended: the shards before the last, partly filled one are kept)"]

    root.mkdir(parents=True, exist_ok=True)
    if data is None:
        shutil.copytree(demo_data_dir(), root / path, ignore=shutil.ignore_patterns("__init__.py", "__pycache__"))
    if records is not None:
        from snakeshard.io.audio_folder import write_records

        (root / "data").mkdir(exist_ok=True)
        write_records(records, root / path)
    config = (TEMPLATE_DIR / "config.yaml").read_text()
    config = config.replace("__DATASET_NAME__", name).replace("__DATASET_PATH__", path)
    # the demo: two shards balanced by audio seconds; the user's data: item counts, which need no
    # durations (any wav.scp works, pipes included); both keep existing shards when data is appended
    # a folder's files, counted: ~8 shards (several a core, as the default), at most 1,000 keys each (a trial's 30
    # files were one shard of 1000, which every added file re-cut whole)
    size = 1000 if records is None else min(1000, max(1, -(-len(records) // 8)))
    config = config.replace("__SHARDING__", "shard_seconds: 18" if data is None else f"shard_size: {size}")
    (root / "config").mkdir(exist_ok=True)
    (root / "config/config.yaml").write_text(config.replace("__DATASET_FORMAT__", fmt))
    (root / "Snakefile").write_text((TEMPLATE_DIR / "Snakefile").read_text().replace("__DATASET_NAME__", name))
    shutil.copyfile(TEMPLATE_DIR / "my_stage.py", root / "my_stage.py")
    for profile in ("local", "slurm"):
        (root / "profiles" / profile).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(profiles_dir() / profile / "config.yaml", root / "profiles" / profile / "config.yaml")
    return list(WRITTEN) + ([path + "/"] if data is None else [path] if records is not None else []), said


def relative_audio_note(data: str | os.PathLike, directory: str | os.PathLike) -> str | None:
    """A note for ``init --data``: the Kaldi dir's wav.scp or the JSON Lines manifest lists a relative audio path
    (its first plain one is looked at) that does not exist from the project ``directory``, where snakemake runs and
    reads it (as Kaldi does, relative paths are taken from the working directory, not from the list's)."""
    listing = Path(data) / "wav.scp" if Path(data).is_dir() else Path(data)
    audio = _first_audio_path(listing)
    if audio is None or os.path.isabs(audio) or (Path(directory) / audio).exists():
        return None
    return (f"note: {listing} lists relative audio paths ({audio}, ...), and snakemake reads them from "
            f"{directory}, where {audio} does not exist: make them absolute, or relative to {directory}")


def manifest_fields_note(data: str | os.PathLike, directory: str | os.PathLike) -> str | None:
    """A note when a JSON Lines manifest's first record lacks the ``key`` or ``audio`` field the config init wrote
    reads by default: the fields it has, and the dataset keys that name them."""
    if Path(data).suffix != ".jsonl" or not Path(data).is_file():
        return None
    with open(data, encoding="utf-8", errors="replace") as f:
        line = next((line for line in f if line.strip()), "")
    try:
        record = json.loads(line)
    except ValueError:  # the parse names the line
        return None
    missing = [field for field in ("key", "audio") if isinstance(record, dict) and field not in record]
    if not missing:
        return None
    name = _describe_data(Path(data), Path(directory))[0]
    return (f"note: {data}: its first record has no {' or '.join(map(repr, missing))} field (it has "
            f"{', '.join(map(repr, record))}): set {', '.join(f'{field}_field' for field in missing)} under "
            f"datasets.{name} in {Path(directory) / 'config/config.yaml'} to the field(s) holding them")


def _first_audio_path(listing: Path) -> str | None:
    """The first audio path a wav.scp or a .jsonl manifest (its ``audio`` field) lists that is not a pipe."""
    if not listing.is_file():
        return None
    with open(listing, encoding="utf-8", errors="replace") as f:
        for line in f:
            if listing.suffix == ".jsonl":
                try:
                    audio = json.loads(line).get("audio") or ""
                except (ValueError, AttributeError):  # a bad line: the parse names it
                    continue
            else:
                parts = line.split(maxsplit=1)
                audio = parts[1].strip() if len(parts) == 2 else ""
            if isinstance(audio, str) and audio and not is_pipe(audio):  # a pipe reads what its command reads
                return audio
    return None


def _describe_data(data: Path, root: Path) -> tuple[str, str, str]:
    """(dataset name, path as the config holds it, format) of the user's data."""
    if not data.exists():
        raise ConfigError(f"--data {data}: does not exist (relative to {os.getcwd()})")
    if data.is_dir():
        # a Kaldi dir has a wav.scp, or a feats.scp (features without audio); any other folder is one of audio files
        fmt = "kaldi" if (data / "wav.scp").is_file() or (data / "feats.scp").is_file() else "folder"
    elif data.suffix == ".jsonl":
        fmt = "jsonl"
    else:
        raise ConfigError(f"--data {data}: give a Kaldi data dir (with wav.scp), a .jsonl manifest or a folder of "
                          "audio files")
    absolute = data.resolve()
    try:
        path = str(absolute.relative_to(root.resolve()))
    except ValueError:
        path = str(absolute)  # outside the project: absolute, so it works from the project dir
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", absolute.stem if fmt == "jsonl" else absolute.name).lstrip("_.-") or "data"
    return name, path, fmt
