"""Checkpoints a kill -9 cannot leave half-written: ``latest.pt``, ``best.pt`` and ``history/step-<N>.pt``.

Each file is written as snakeshard.io.atomic writes any file: to a temp file beside it, fsynced, renamed,
and the directory fsynced. The history keeps the ``keep_latest_k`` newest steps. Loading ``latest.pt``
that cannot be read (truncated, empty, not a torch file) falls back to the newest readable history file,
with a ``CheckpointWarning`` naming both. Temp files a killed writer left are removed on load.
Checkpoints hold optimizer and scheduler states of any kind, so they are read with
``weights_only=False``: load only a run directory you trust (your own runs').
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from pathlib import Path

from snakeshard.errors import SnakeshardError
from snakeshard.io.atomic import atomic_write_bytes, remove_temps_in

_HISTORY_NAME = re.compile(r"^step-(\d+)\.pt$")
# What torch 2.13's load raises for a file that is empty, cut short by a kill or not torch's (checked on each);
# a sound file that names code that no longer imports raises ImportError or AttributeError instead.
UNREADABLE = (EOFError, OSError, RuntimeError, ValueError, pickle.UnpicklingError)


class CheckpointWarning(UserWarning):
    """A checkpoint could not be read and an older one was used instead."""


class UnreadableCheckpoints(SnakeshardError, RuntimeError):
    """Checkpoint files exist and none of them reads: named, with how to start over (one error line, as every
    snakeshard error, where a bare RuntimeError was a traceback)."""


class CheckpointManager:
    def __init__(self, directory: str | os.PathLike, *, keep_latest_k: int = 3):
        self.directory = Path(directory)
        self.history = self.directory / "history"
        self.keep_latest_k = int(keep_latest_k)
        self.latest = self.directory / "latest.pt"
        self.best = self.directory / "best.pt"

    def save(self, state: dict, *, step: int, best: bool = False) -> None:
        """Write ``state`` to ``best.pt`` (with ``best``), ``history/step-<step>.pt`` (when keep_latest_k > 0)
        and ``latest.pt``, in that order; then drop history beyond the newest keep_latest_k. A kill between
        two of them leaves no checkpoint that counts this step's best without ``best.pt`` holding it (were
        ``best.pt`` last, a kill before it left ``latest.pt`` naming a best epoch whose weights were never
        written, and the run ended on a missing or older ``best.pt``); a ``best.pt`` newer than ``latest.pt``
        is written again, the same, when the resumed run replays that epoch. The history file comes before
        ``latest.pt``, so a kill between them leaves a history file at least as new as ``latest.pt``."""
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        self.directory.mkdir(parents=True, exist_ok=True)
        if best:
            atomic_write_bytes(self.best, data)
        if self.keep_latest_k > 0:
            self.history.mkdir(exist_ok=True)
            atomic_write_bytes(self.history / f"step-{step}.pt", data)
        atomic_write_bytes(self.latest, data)
        self._prune()

    def history_files(self) -> list[Path]:
        """History checkpoints, newest step first."""
        if not self.history.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.history.iterdir() if (m := _HISTORY_NAME.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def _prune(self) -> None:
        for old in self.history_files()[max(self.keep_latest_k, 0):]:
            old.unlink(missing_ok=True)

    def remove_temps(self) -> list[Path]:
        """Remove temp files a killed writer left here and in history/ (this run's directory has one writer)."""
        return [Path(p) for folder in (self.directory, self.history) for p in remove_temps_in(folder)]

    def load_latest(self) -> tuple[dict, Path] | None:
        """The newest readable checkpoint and its path: ``latest.pt``, else history newest first (warning
        about each unreadable one); None when there is none at all. Raises when files exist but none reads."""
        self.remove_temps()
        return self.read_newest()

    def read_newest(self) -> tuple[dict, Path] | None:
        """``load_latest`` without its cleaning of a killed save's temp files (``snakeshard status`` reads)."""
        history = self.history_files()
        failed: list[tuple[Path, str]] = []
        found = self._first_readable(([self.latest] if self.latest.exists() else []) + history, failed)
        if found is not None and found[1] == self.latest:
            # A kill between a save's history file and its latest.pt leaves latest.pt a save behind: the newer
            # history file is as whole (written atomically) and its steps need not be taken again.
            step = found[0]["progress"]["step"]
            newer = self._first_readable([h for h in history if _history_step(h) > step], failed)
            found = newer or found
        for bad, why in failed:
            if found is not None:
                warnings.warn(f"checkpoint {bad} is unreadable ({why}); resuming from {found[1]} instead",
                              CheckpointWarning, stacklevel=2)
        if found is None and failed:
            raise UnreadableCheckpoints("no readable checkpoint: " + "; ".join(f"{p} ({why})" for p, why in failed)
                                        + f". Delete {self.directory} (or pass restart) to start over")
        return found

    @staticmethod
    def _first_readable(candidates: list[Path], failed: list) -> tuple[dict, Path] | None:
        """The first of ``candidates`` that reads, and its path; each one before it that does not is added to
        ``failed`` with why."""
        for path in candidates:
            try:
                return read_checkpoint(path), path
            except UNREADABLE as e:
                failed.append((path, f"{type(e).__name__}: {e}".splitlines()[0][:200]))
            except (ImportError, AttributeError) as e:  # a sound file naming code that does not import now
                raise UnreadableCheckpoints(
                    f"checkpoint {path} reads, but names code that does not import now ({type(e).__name__}: {e}): "
                    "restore that module or class, or move the checkpoints away to start over") from e
        return None


def _history_step(path: Path) -> int:
    return int(_HISTORY_NAME.match(path.name).group(1))


def read_checkpoint(path: str | os.PathLike) -> dict:
    """A checkpoint or model file of a run (a dict), on the CPU; raises one of UNREADABLE when it does not read."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a checkpoint dict")
    return state
