"""A shell command as a stage: Kaldi's binaries and scripts (or any tool that reads Kaldi tables) run over each shard
as a Kaldi data dir of its keys, as ``run.pl JOB=1:N`` runs them per ``split_data.sh`` split, with snakeshard's plan,
``done``, merge and resume around them.

``provider_config``:
  command  the bash command (run with ``set -o pipefail``, in the directory snakemake runs in). ``{data}`` is a
           Kaldi data dir of the batch's keys (``wav.scp``, ``segments``, ``text``, ``utt2spk``, ``spk2utt``,
           ``feats.scp``, as the dataset has them), ``{out}`` an empty directory for what it writes. Nothing else
           in it is substituted, so awk's and perl's braces stay as written.
  reads    ``{field: file}``, the files in ``{out}`` that become the stage's fields: a ``*.scp`` is read as Kaldi
           matrices (kaldiio; written as an ark field), any other file as a Kaldi table of ``key value`` lines (a
           text field). Each must hold every key of the batch once and no other: a Kaldi tool that skips a key it
           failed on (with a WARNING in its log) fails the shard here, naming the key.
  files    the files the command reads besides the data (configs, models, scripts): their size and mtime count in
           the stage's fingerprint, as a model file's do, so an edit of ``conf/mfcc.conf`` reruns every shard.

One command per 1,000 keys of a shard (``batch_size`` sets it): what it writes is held in memory until written. Its output (Kaldi's ``LOG`` lines
included) goes to the shard's log; a failing command fails the shard with its exit status and its last lines.
"""

from __future__ import annotations

import os

from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard.core.data import FEATS, load_dataset, read_kaldi_matrix, read_kaldi_table
from snakeshard.errors import ConfigError, DataError

WHERE = "stages.<stage>.provider_config"
TAIL_LINES = 5  # of a failing command's output, in the shard's error line


class CommandProvider(EnvironmentProvider):
    """The dataset and the command, its outputs and its files, checked."""

    config_keys = ("command", "reads", "files", "tmpdir")

    def build_env_local(self) -> dict:
        config = self.config
        command = config.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ConfigError(f"{WHERE}.command: give the shell command to run over each shard ({{data}}: its Kaldi "
                              "data dir, {out}: the directory it writes to)")
        reads = config.get("reads")
        if not isinstance(reads, dict) or not reads or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in reads.items()):
            raise ConfigError(f"{WHERE}.reads: give the files the command writes in {{out}} as {{field: file}}, e.g. "
                              "{feats: feats.scp} (*.scp: Kaldi matrices; else 'key value' lines)")
        if "{out}" not in command:
            raise ConfigError(f"{WHERE}.command: it must write {sorted(reads.values())} into {{out}}, which it never "
                              f"names: {command!r}")
        for file in reads.values():
            if os.path.basename(file) != file:
                raise ConfigError(f"{WHERE}.reads: {file!r} must be a file name in {{out}}, not a path")
        files = config.get("files", [])
        if not isinstance(files, list):
            raise ConfigError(f"{WHERE}.files: a list of the files the command reads, got {files!r}")
        for i, file in enumerate(files):
            if not isinstance(file, str) or not os.path.isfile(file):
                raise ConfigError(f"{WHERE}.files[{i}]: {file!r} is not a file (relative paths are taken from "
                                  f"{os.getcwd()})")
        return {"dataset": load_dataset(self.config["dataset"]), "command": command, "reads": dict(reads),
                "tmpdir": config.get("tmpdir")}


class CommandRunner(BaseRunner):
    """The command over each batch of a shard's keys; its files read back per key."""

    # Keys per command (the stage's batch_size sets it): run.pl runs one per split, but a command's outputs are
    # held in memory until written, and 1,000 keys of 10 s of 80-dim fbank are ~300 MB.
    batch_size = 1000

    @staticmethod
    def forward(keys, *, dataset, command, reads, tmpdir=None):
        import tempfile

        batch = keys if isinstance(keys, list) else [keys]
        with tempfile.TemporaryDirectory(prefix="snakeshard-command-", dir=tmpdir) as scratch:
            data, out = os.path.join(scratch, "data"), os.path.join(scratch, "out")
            os.mkdir(out)
            write_data_dir(dataset, batch, data)
            run_command(command, {"{data}": data, "{out}": out}, batch)
            fields = {field: read_output(os.path.join(out, file), file, batch) for field, file in reads.items()}
        results = [{field: values[key] for field, values in fields.items()} for key in batch]
        return results if isinstance(keys, list) else results[0]


def write_data_dir(dataset, keys: list[str], path: str) -> None:
    """A Kaldi data dir of ``keys`` as ``dataset`` has them, in their order: wav.scp (of the recordings, with
    segments when the keys are cut from them), text, utt2spk and spk2utt, feats.scp; a file only when some key has
    its field."""
    tables: dict[str, list[str]] = {name: [] for name in ("wav.scp", "segments", "text", "utt2spk", "feats.scp")}
    recordings: dict[str, str] = {}
    speakers: dict[str, list[str]] = {}
    for key in keys:
        record = dataset[key]
        if "start" in record:  # a segment: its recording once in wav.scp, its times as Kaldi writes them
            if record["rec"] not in recordings:
                recordings[record["rec"]] = record["audio"]
                tables["wav.scp"].append(f"{record['rec']} {record['audio']}")
            tables["segments"].append(f"{key} {record['rec']} {record['start']:.15g} {record['end']:.15g}")
        elif record.get("audio") is not None:
            tables["wav.scp"].append(f"{key} {record['audio']}")
        for name, field in (("text", "text"), ("utt2spk", "spk"), ("feats.scp", FEATS)):
            if field in record:
                tables[name].append(f"{key} {record[field]}")
        if "spk" in record:
            speakers.setdefault(record["spk"], []).append(key)
    tables["spk2utt"] = [f"{spk} {' '.join(utts)}" for spk, utts in speakers.items()]
    os.mkdir(path)
    for name, lines in tables.items():
        if lines:
            with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))


def run_command(command: str, dirs: dict[str, str], keys: list[str]) -> None:
    """Run ``command``, its ``{data}`` and ``{out}`` replaced by ``dirs``, under bash with pipefail; its output to
    the shard's log (stderr); a failure named with its exit status, its last lines and the keys it ran over."""
    import subprocess
    import sys

    script = command
    for placeholder, path in dirs.items():
        script = script.replace(placeholder, path)
    done = subprocess.run(["bash", "-c", "set -o pipefail\n" + script], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    output = done.stdout.decode("utf-8", "replace")
    sys.stderr.write(output)
    sys.stderr.flush()
    if done.returncode:
        tail = " | ".join(line for line in output.splitlines()[-TAIL_LINES:] if line.strip()) or "no output"
        status = (f"was killed by signal {-done.returncode}" if done.returncode < 0
                  else f"exited with status {done.returncode}")
        which = f"key {keys[0]!r}" if len(keys) == 1 else f"{len(keys)} keys ({keys[0]!r}..{keys[-1]!r})"
        raise DataError(f"the command over {which} {status} ({WHERE}.command: {command}); its last lines: {tail}")


def read_output(path: str, name: str, keys: list[str]) -> dict:
    """The values of ``path`` per key: matrices from a ``.scp``, else the text of ``key value`` lines; every key of
    the batch there once, and no other."""
    if not os.path.isfile(path):
        raise DataError(f"the command wrote no {name} in {{out}} ({WHERE}.reads names it)")
    def where(line_no: int) -> str:
        return f"{name}:{line_no} (written by {WHERE}.command)"

    values: dict[str, tuple] = {}
    for key, value, line_no in read_kaldi_table(path):
        if key in values:
            raise DataError(f"{where(line_no)}: key {key!r} a second time (first at line {values[key][1]})")
        values[key] = (value, line_no)
    wanted = set(keys)
    missing = [k for k in keys if k not in values]
    if missing:
        raise DataError(f"{name}: the command wrote {len(keys) - len(missing)} of the batch's {len(keys)} keys; "
                        f"missing: {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                        + " (a Kaldi tool skips a key it fails on: the WARNING above in this log says why)")
    stray = next((k for k in values if k not in wanted), None)
    if stray is not None:
        raise DataError(f"{where(values[stray][1])}: key {stray!r} is not one of the batch's keys")
    if name.endswith(".scp"):
        return {k: read_kaldi_matrix(v, f"key {k!r}: {where(n)}:") for k, (v, n) in values.items()}
    return {k: v for k, (v, _) in values.items()}
