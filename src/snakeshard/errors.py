"""Errors that a user is meant to read.

Every error snakeshard raises on bad input is a ``SnakeshardError`` whose message
names what the user has to look at: the item key, the shard, the file and line.
The CLI prints the message alone (no traceback) and exits non-zero.
"""

import contextlib

ERROR_PREFIX = "snakeshard: error: "  # how every command and job prints a SnakeshardError: one line, this prefix
# What snakeshard says among Snakemake's own lines (the parse, a job's log) starts with one of these, so that it stands
# out and can be grepped for; its own commands (status, plan) print plain `note:` lines.
NOTE_PREFIX = "snakeshard: note: "  # worth a look; nothing was refused
WARNING_PREFIX = "snakeshard: warning: "  # something went otherwise than asked, and the run went on
MAX_LISTED = 5  # how many offenders (keys, files, shards) one message lists before "and N more"


class SnakeshardError(Exception):
    """Base class: a problem with the user's data, config or code, not a snakeshard bug."""


class ConfigError(SnakeshardError):
    """``config/config.yaml`` (or a stage in it) is invalid."""


class DataError(SnakeshardError):
    """The input data (wav.scp, jsonl, audio files) is invalid: names file and line."""


class AudioError(DataError):
    """One key's audio cannot be used as the stage needs it (unreadable, truncated, empty, another sample rate, a
    segment past its end). ``key`` names it, so that a shard that fails on it can name its other keys that would."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class ContractError(SnakeshardError):
    """A runner or provider breaks the contract (env names, return values)."""


class ShardError(SnakeshardError):
    """An item failed inside a shard job: names key, shard and log file."""


class MergeError(SnakeshardError):
    """Shard fragments cannot be merged: names shard, fragment and key."""


STAGE_KEY = "stages.<stage>."  # how messages of code that does not know the stage name its config keys


def in_stage(text: str, stage: str) -> str:
    """``text`` with its ``stages.<stage>.`` config keys naming ``stage``."""
    return text.replace(STAGE_KEY, f"stages.{stage}.")


@contextlib.contextmanager
def naming_stage(stage: str):
    """A SnakeshardError raised inside, its ``stages.<stage>.`` keys naming ``stage``: the dataset readers, writers
    and shipped providers word their errors so (they run in-process too, where there is no stage)."""
    try:
        yield
    except SnakeshardError as e:
        named = in_stage(str(e), stage)
        if named == str(e):
            raise
        raise type(e)(named) from e.__cause__
