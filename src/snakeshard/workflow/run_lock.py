"""Snakemake's run lock: whether a lock in ``.snakemake/locks`` is a dead driver's, so that the parse and
``snakeshard status`` can say so with the command that clears it, before Snakemake stops on its LockException.

Snakemake 9's lock files list the locked paths, not the process that holds them: what can be known is only that
no snakemake process runs in the directory on this machine (read from /proc).
"""

from __future__ import annotations

import os

from snakeshard.errors import NOTE_PREFIX


def stale_lock_note(directory: str, argv: list[str], pid: int) -> str | None:
    """What to say at parse when Snakemake's lock files are in ``directory``/.snakemake/locks and no other snakemake
    process runs in ``directory`` on this machine (the pid ``pid`` and its parents aside): the lock is most likely
    a dead driver's (kill -9, a lost node, a power loss), and Snakemake will stop with its LockException after the
    parse. None otherwise, or where /proc does not say (not Linux), or when ``argv`` (snakemake's own) unlocks.

    Snakemake 9's lock files (``N.input.lock``, ``N.output.lock``) list the locked paths, not the process that
    holds them, so which run left them cannot be known: only that no snakemake runs here now. A snakemake in the
    same directory on another machine (a shared filesystem) is not seen, and the note says so.
    """
    if "--unlock" in argv or not dead_run_lock(directory, pid):
        return None
    import shlex

    command = "snakemake" + "".join(f" --profile {shlex.quote(p)}" for p in _profile_of(argv)) + " --unlock"
    return (f"{NOTE_PREFIX}{DEAD_RUN_LOCK}. If snakemake stops below with a LockException and none runs here on "
            f"another machine either, clear the lock, then run again:\n    {command}")


# what the parse's note and `snakeshard status` say of a lock no snakemake here holds
DEAD_RUN_LOCK = (".snakemake/locks holds a lock from an earlier snakemake run, and no snakemake runs in this directory "
                 "on this machine (a driver killed with kill -9 leaves its lock)")


def dead_run_lock(directory: str, pid: int) -> bool:
    """Whether ``directory``/.snakemake/locks holds lock files while no snakemake process runs in ``directory`` on
    this machine (``pid`` and its parents aside): most likely a dead driver's (see stale_lock_note)."""
    locks = os.path.join(directory, ".snakemake", "locks")
    try:
        if not any(name.endswith(".lock") for name in os.listdir(locks)):
            return False
    except OSError:  # no lock dir
        return False
    return snakemake_processes_in(directory, pid) == []


def _profile_of(argv: list[str]) -> list[str]:
    """The --profile snakemake was given (on its command line, else $SNAKEMAKE_PROFILE), as a list of 0 or 1."""
    for i, arg in enumerate(argv):
        if arg == "--profile" and i + 1 < len(argv):
            return [argv[i + 1]]
        if arg.startswith("--profile="):
            return [arg.partition("=")[2]]
    return [os.environ["SNAKEMAKE_PROFILE"]] if os.environ.get("SNAKEMAKE_PROFILE") else []


def snakemake_processes_in(directory: str, pid: int) -> list[int] | None:
    """The pids of snakemake processes whose working directory is ``directory``, but ``pid`` and its ancestors (a
    ``timeout`` or shell wrapping it); None where /proc cannot tell (not Linux). Read from /proc/*/cwd and cmdline."""
    if not os.path.isdir("/proc/self"):
        return None
    own = set()
    while pid > 1 and pid not in own:  # pid and its ancestors
        own.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])  # the field after the state: the parent's pid
        except (OSError, ValueError, IndexError):
            break
    target = os.path.realpath(directory)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in own:
            continue
        try:
            if os.readlink(f"/proc/{entry}/cwd") != target:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:  # gone, or another user's
            continue
        if _is_snakemake(args):
            found.append(int(entry))
    return found


def _is_snakemake(args: list[str]) -> bool:
    """``snakemake ...``, ``python /venv/bin/snakemake ...`` or ``python -m snakemake ...`` (a job's
    ``python -m snakeshard`` is not)."""
    if any(os.path.basename(arg) == "snakemake" for arg in args[:2]):
        return True
    return any(a == "-m" and b == "snakemake" for a, b in zip(args, args[1:]))
