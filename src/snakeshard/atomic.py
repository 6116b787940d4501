"""Write-then-rename helpers: a file either has its complete new content or does not change."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def atomic_write_bytes(path: str | os.PathLike, data: bytes | list[bytes], *, fsync: bool = True) -> None:
    """Write ``data`` (bytes, or a list of parts) to a temp file beside ``path`` and rename it into place.

    A kill -9 at any point leaves either the old file or the new one, never a
    truncated one. ``fsync`` also survives power loss; skip it for files that can
    be recomputed cheaply (plan key lists), where thousands of fsyncs would cost seconds.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 less the umask),
        # so teammates on a shared filesystem can read results.
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.writelines([data] if isinstance(data, bytes) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (the new directory entry survives a power loss)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it (os.umask can only be read by setting it,
    which would race with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc (macOS): set and restore
    os.umask(mask)
    return mask


def atomic_write_json(path: str | os.PathLike, obj, *, fsync: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n", fsync=fsync)


def write_if_changed(path: str | os.PathLike, text: str) -> bool:
    """Rewrite ``path`` only when its content differs, so its mtime (a Snakemake trigger) stays put."""
    path = Path(path)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text, fsync=False)
    return True
