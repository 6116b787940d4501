"""Complete recipes (``snakeshard init --recipe NAME DIR``): a project that runs every kind of stage together on
real data, as ESPnet's egs2/*/run.sh and Kaldi's egs/yesno do. A recipe's files are package data in its own
directory; its data prep is a module here (``fsdd.py``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from snakeshard.errors import ConfigError
from snakeshard.resources import PACKAGE_DIR, profiles_dir

RECIPES = {"digits": "spoken digits (FSDD): data prep, fbank, stats, train, inference, scoring"}
# a file of the recipe's directory -> where the project gets it
FILES = {"Snakefile": "Snakefile", "config.yaml": "config/config.yaml", "speakers.yaml": "config/speakers.yaml",
         "digits.py": "digits.py", "README.md": "README.md"}
PROFILES = ("profiles/local/config.yaml", "profiles/slurm/config.yaml")


def init_recipe(name: str, directory: str | os.PathLike, data: str | None = None) -> list[str]:
    """Write recipe ``name`` into ``directory`` (created if missing); ``data``: a local copy of its recordings,
    else its data prep downloads them. Refuses to overwrite any file it would write; returns the files written."""
    if name not in RECIPES:
        raise ConfigError(f"--recipe {name!r}: no such recipe; there is {', '.join(sorted(RECIPES))}")
    root = Path(directory)
    clashes = [path for path in (*FILES.values(), *PROFILES) if (root / path).exists()]
    if clashes:
        raise ConfigError(f"{root} already has {', '.join(clashes)}: not overwriting (choose an empty directory)")
    recordings = "null"
    if data is not None:
        if not Path(data).is_dir() or not any(Path(data).glob("*.wav")):
            raise ConfigError(f"--data {data}: no directory of FSDD's WAVs ({{digit}}_{{speaker}}_{{take}}.wav, as the "
                              f"dataset's recordings/ directory) there, relative to {os.getcwd()}")
        recordings = json.dumps(str(Path(data).resolve()))  # absolute: the project may move; JSON quotes are YAML
    source = PACKAGE_DIR / "recipes" / name
    for src, dst in FILES.items():
        text = (source / src).read_text()
        if dst == "config/config.yaml":
            text = text.replace("__RECORDINGS__", recordings)
        (root / dst).parent.mkdir(parents=True, exist_ok=True)
        (root / dst).write_text(text)
    for path in PROFILES:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(profiles_dir() / Path(path).relative_to("profiles"), root / path)
    return [*FILES.values(), *PROFILES]
