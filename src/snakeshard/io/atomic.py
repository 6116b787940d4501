"""Write-then-rename helpers: a file either has its complete new content or does not change."""

from __future__ import annotations

import json
import os


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def atomic_write_bytes(path: str | os.PathLike, data: bytes | list[bytes], *, fsync: bool = True) -> None:
    """Write ``data`` (bytes, or a list of parts) to a temp file beside ``path`` and rename it into place.

    A kill -9 at any point leaves either the old file or the new one, never a
    truncated one. ``fsync`` also survives power loss; skip it for files that can
    be recomputed cheaply (plan key lists), where thousands of fsyncs would cost seconds.
    """
    path = os.fspath(path)
    fd, tmp = _create_temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.writelines([data] if isinstance(data, bytes) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")


_TEMP_TOKEN_CHARS = 12  # hex digits of the random part of a temp name (6 bytes)


def _create_temp_beside(path: str) -> tuple[int, str]:
    """A new file ``.NAME.<random>.tmp`` in ``path``'s directory, opened for writing: (fd, its path).

    What tempfile.mkstemp does (O_EXCL, a fresh name on a clash), without importing tempfile, which
    costs every shard job ~4 ms; and with the mode a plain open() gives (0666 less the umask, where
    mkstemp gives 0600), so teammates on a shared filesystem can read results.
    """
    parent, name = os.path.split(path)
    for _ in range(100):
        tmp = os.path.join(parent, f".{name}.{os.urandom(_TEMP_TOKEN_CHARS // 2).hex()}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary name beside {path}")


def remove_temps_of(path: str | os.PathLike) -> list[str]:
    """Remove the temp files a writer of ``path`` killed before its rename left beside it; returns their paths.
    For a writer that runs alone on ``path`` (the merge of a set): another live writer's temp file would go too."""
    parent, name = os.path.split(os.fspath(path))
    return remove_temps_in(parent or ".", name)


def remove_temps_in(directory: str | os.PathLike, name: str | None = None) -> list[str]:
    """Remove the temp files ``.NAME.<12 hex>.tmp`` in ``directory`` (of the file ``name`` only, if given; other
    dot files are not ours); returns their paths."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if _is_temp_name(entry.name, name) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            removed.append(entry.path)
    return removed


def _is_temp_name(entry: str, name: str | None) -> bool:
    """``entry`` is a name _create_temp_beside gives (beside the file ``name``, if given)."""
    if not (entry.startswith(".") and entry.endswith(".tmp")):
        return False
    target, _, token = entry[1:-len(".tmp")].rpartition(".")
    return (bool(target) and (name is None or target == name) and len(token) == _TEMP_TOKEN_CHARS
            and all(c in "0123456789abcdef" for c in token))


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (the new directory entry survives a power loss)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj, *, fsync: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n", fsync=fsync)


def write_if_changed(path: str | os.PathLike, text: str) -> bool:
    """Rewrite ``path`` only when its content differs, so its mtime (a Snakemake trigger) stays put."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return False
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_text(path, text, fsync=False)
    return True
