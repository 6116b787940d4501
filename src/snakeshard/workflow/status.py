"""``snakeshard status``: each shard's, merge's and training's state, read from the files on disk against the
fingerprints a parse of the project's config gives now (nothing is run; Snakemake is not asked), and from
SLURM's queue when a recent run here submitted to it (``squeue``).

A shard is done, stale (with what changed), moved, unreadable, failed (with its log's lines), incomplete, pending,
or queued or running in a SLURM job; a merge current, stale, missing, moved, failed, or made again (with why
Snakemake remakes it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from snakeshard.core.data import listing
from snakeshard.core.merge import (UnreadableDone, done_moved, missing_merged_files, moved_fix, moved_from, read_done,
                                   remerge_fix)
from snakeshard.core.merged_files import merged_record
from snakeshard.core.plan import shards_text
from snakeshard.core.shard import ATTEMPT_FILE
from snakeshard.core.shard_files import MERGE_LOG
from snakeshard.errors import ERROR_PREFIX, MAX_LISTED
from snakeshard.train.stage import training_state
from snakeshard.workflow.job import INTERRUPTED, RERUN, STOPPED, canary_log_head
from snakeshard.workflow.parse import (CANARY_DIR, FINGERPRINT_DEFAULTS, counted_records, set_dir, stage_changes,
                                       stage_sets)
from snakeshard.workflow.run_lock import DEAD_RUN_LOCK, dead_run_lock
from snakeshard.workflow.train_config import model_source


def merged_state(set_dir: Path, inputs: str) -> str:
    """yes (made from the current plan's inputs, here) / stale (from other inputs) / moved (its scp files point
    into the directory it was made in) / missing (a file its merged.json lists is gone) / no."""
    record = merged_record(set_dir)
    if record is None:
        return "no"
    if record.get("inputs") != inputs:
        return "stale"
    if moved_from(set_dir, record):
        return "moved"
    return "missing" if missing_merged_files(set_dir, record) else "yes"


SLURM_JOB_LINE = re.compile(r", SLURM job (\d+)$")  # the end of a job log's first line (workflow.job.started_line)

# What a stale shard's done differs in, in the words status uses.
STALE_CAUSES = {"keys": "its keys (the plan was cut anew)",
                "records": "its keys' lines in {files}",  # the record files the stage's fingerprint counts
                "audio": "its audio files (size or mtime)", "stage": "the stage's config, model files or code",
                "upstream": "the upstream stage's output for its keys"}


def shard_state(shard_dir: Path, log: Path, expected: dict, shard: int, record_files: list[str]) -> tuple[str, str]:
    """(state, detail): done, stale (with what changed), unreadable, failed (with log tail),
    incomplete (started, no result), pending. ``expected``: the shard's entry in the current fingerprints.
    ``log`` may be a job's of several shards (``shards_per_job``): the error line naming ``shard`` counts.
    ``record_files``: the files whose lines the stage's fingerprint counts (a stale shard's records are one of them:
    the done keeps one digest over them)."""
    try:
        done = read_done(shard_dir)
    except UnreadableDone as e:
        return "unreadable", str(e)
    if done is not None:
        if done.get("fingerprint") == expected["fingerprint"]:
            if done_moved(done, shard_dir):
                return "moved", (f"computed in {done['shard_dir']}: its scp files point there; "
                                 + moved_fix(shard_dir.parent.parent.name))
            return "done", ""
        had = done.get("inputs") or {}
        changed = [part for part in STALE_CAUSES if part in had and had[part] != expected[part]]
        if "keys" in changed:  # a plan cut anew: other keys come with other records and audio, nothing to tell
            changed = [part for part in changed if part not in ("records", "audio")]
        files = ", ".join(record_files[:-1]) + " or " * (len(record_files) > 1) + record_files[-1]
        causes = [STALE_CAUSES[part].format(files=files) for part in changed]
        if "stage" in changed:  # what in the stage, when its history still holds the fingerprint the shard ran with
            what = stage_changes(shard_dir.parent, had["stage"], expected["stage"])
            if what:
                causes[changed.index("stage")] = "the stage: " + "; ".join(what[:5])
        return "stale", "changed since it ran: " + (", ".join(causes) or "its inputs, config or code")
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    own = [n for n, line in enumerate(lines) if line.startswith((f"{ERROR_PREFIX}shard {shard} ",
                                                                   f"{ERROR_PREFIX}shard {shard}:"))]
    if own:  # this shard's error line and the end of its traceback above it (a job's log may hold several shards)
        return "failed", "\n".join("      | " + line for line in lines[max(0, own[-1] - 3):own[-1] + 1])
    tail = lines[-5:]
    if any(line.startswith(ERROR_PREFIX) for line in tail) or any("Error" in line for line in tail[-1:]):
        return "failed", "\n".join("      | " + line for line in tail)
    if (shard_dir / ATTEMPT_FILE).exists():
        if any(f": {INTERRUPTED};" in line for line in tail):  # the job's own line on Ctrl-C (workflow.job)
            return "incomplete", "interrupted (SIGINT, Ctrl-C): the next run runs it again"
        stopped = [line for line in tail if f": {STOPPED}" in line]  # its line on SIGTERM: scancel, a time limit
        if stopped:
            return "incomplete", stopped[-1].split(": ", 2)[-1].removesuffix(RERUN) + (
                ": the next run runs it again")
        if attempt_running(shard_dir):
            return "incomplete", "running now"
        job = SLURM_JOB_LINE.search(lines[0]) if lines else None
        if job:  # its log's first line names its SLURM job (workflow.job.started_line): say where to look
            logs = sorted(Path(".snakemake/slurm_logs").glob(f"*/*/{job.group(1)}.log"))
            where = f"; its SLURM log: {logs[0]}" if logs else ""
            return "incomplete", (f"started in SLURM job {job.group(1)}, no done and no error line: still running, or "
                                  f"killed (out of memory, its time limit): `sacct -j {job.group(1)} -o "
                                  f"State,MaxRSS,Elapsed` says which{where}")
        return "incomplete", ("started, no done, and no attempt holds it here: killed, its done deleted, or running "
                              "on another node (if its log has no error, the cause may be in snakemake's own output)")
    return "pending", ""


def attempt_running(shard_dir: Path) -> bool:
    """Whether an attempt holds the shard's ``.attempt`` lock (core.shard.claimed_shard_dir): a job running on this
    machine, or on another one where the shared filesystem passes flocks on."""
    import fcntl

    try:
        with open(shard_dir / ATTEMPT_FILE) as attempt:
            fcntl.flock(attempt, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def canary_failure(stage: str, canary: dict, log: Path) -> str | None:
    """The error line of the stage's canary when the current fingerprint's canary has no done and its log (the
    stage's, written by its last canary job) is that fingerprint's and ends in an error; None otherwise (canary
    off, done, not run yet, running, or the log of an earlier fingerprint)."""
    if Path(canary["dir"], "done").exists() or not log.is_file():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    if not lines or lines[0] != canary_log_head(stage, canary["fingerprint"]) or not lines[-1].startswith(ERROR_PREFIX):
        return None
    return lines[-1]


def merge_failure(set_dir: Path, log: Path) -> str | None:
    """The error line of the set's last merge when it failed with its shards as they are now (its log ends in an
    error and is newer than every shard's done); None otherwise (not run, succeeded, or shards ran again since)."""
    if not log.is_file():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    if not lines or not lines[-1].startswith(ERROR_PREFIX):
        return None
    dones = [done.stat().st_mtime_ns for done in set_dir.glob("split.*/done")]
    return None if dones and max(dones) > log.stat().st_mtime_ns else lines[-1]


def merged_line(merged: str, set_dir: Path, stage: str, removed: bool) -> str:
    """What status says of a set's merge (see merged_state)."""
    if merged == "yes":
        return "yes, current" + (" (the merged output does not need the removed shards' done files)" if removed else "")
    if merged == "stale":
        return ("stale (made from other data, config or code than the current plan; snakeshard refuses to read it, "
                "the next successful snakemake run replaces it)")
    if merged == "missing":
        missing = missing_merged_files(set_dir, merged_record(set_dir))
        return (f"missing {', '.join(missing[:MAX_LISTED])} (its merged.json lists it; snakeshard refuses to read the "
                f"set): {remerge_fix(set_dir)}")
    if merged == "moved":
        return (f"moved (made in {merged_record(set_dir)['set_dir']}, and its scp files point there; snakeshard "
                f"refuses to read it): {moved_fix(stage)}")
    return "no"


def remade_because(wf, stage: str, ds: str, trainings: dict, memo: dict) -> str | None:
    """Why snakemake makes a set's merge again though its shards' fingerprints are current, or None: the model it
    infers with is not the current one, or the set it reads from is not (Snakemake reruns what follows an input it
    makes again; the fingerprints cannot tell while the old model or upstream output is still on disk)."""
    if (stage, ds) not in memo:
        memo[stage, ds] = None
        source = model_source(wf.config, stage)
        up = wf.upstream.get((stage, ds))
        newer = newer_than_merge(Path(wf.out) / stage / ds, wf.job_done_files(stage, ds))
        shards = range(wf.plans[stage, ds]["num_shards"])
        if newer:  # Snakemake's mtime trigger: a merge input newer than its output
            memo[stage, ds] = f"{newer} is newer than its merged.json: a shard job ran since the merge"
        elif (late := next((n for n in shards if upstream_newer(wf, stage, ds, n)), None)) is not None:  # a shard's
            memo[stage, ds] = f"split.{late} runs again: an input from another stage is newer than its done"
        elif source and trainings[source][0] != "done":
            memo[stage, ds] = f"its model, training stage {source}, is {trainings[source][0]}"
        elif up and (_upstream_rerun(wf, stage, up) or remade_because(wf, *up, trainings, memo)):
            memo[stage, ds] = f"it reads stage {up[0]}, dataset {up[1]}, which is made again"
    return memo[stage, ds]


def _upstream_rerun(wf, stage: str, up: tuple[str, str]) -> bool:
    """Whether Snakemake reruns what a chained set's jobs read of its upstream set ``up``: its merge, for a stage
    that reads the whole merged output; else its shards, one of which is not current. A merge made again over
    current shards (a merged file deleted) remakes no reader of the shards (a user trial: status said it did)."""
    merged = merged_state(Path(wf.out) / up[0] / up[1], wf.inputs[up])
    if stage in wf.merge_readers:
        return merged != "yes"
    # a done deleted under a current merge is not rerun, nor a moved project's shard
    return any(state not in ("done", "moved") and not deleted
               for _, state, _, deleted in set_shard_states(wf, *up, merged))


def set_shard_states(wf, stage: str, ds: str, merged: str):
    """Per shard of a set: its plan entry, its state and detail (from its dir, its log and the fingerprints it must
    have now), and whether its done was deleted under a current merge (``merged``, the set's merged_state, "yes")."""
    base = Path(wf.out) / stage / ds
    counted = counted_records(wf.specs[stage, ds]["fingerprint"]["records"])
    for shard, expected in zip(wf.plans[stage, ds]["shards"], wf.shard_inputs[stage, ds]):
        n = shard["shard"]
        files = [name for name in FINGERPRINT_DEFAULTS["records"] if name in counted and name in shard["records"]]
        state, detail = shard_state(base / f"split.{n}", Path(wf.shard_job_files(stage, ds, n)[0]),
                                    {**expected, "stage": wf.stage_fps[stage, ds]}, n, files or ["its record files"])
        if state == "done" and (newer := upstream_newer(wf, stage, ds, n)):
            state, detail = "stale", f"{newer} is newer than its done: snakemake runs it again"
        yield shard, state, detail, state in ("pending", "incomplete") and merged == "yes"


def upstream_newer(wf, stage: str, ds: str, n: int) -> str | None:
    """The first file of another stage's that shard ``n``'s job waits for (an upstream shard's done, a merged.json,
    a trained model's done) modified after the shard's done, or None. Snakemake reruns a job whose input is newer
    than its output though no fingerprint changed: an upstream shard forced to run again (a user trial: status
    said current, snakemake -n reran 2 shards). A job of several shards is left out: it skips its shards that are
    done for their current inputs."""
    output = wf.shard_job_files(stage, ds, n)[1]
    if not wf.waits_upstream(stage) or not output.endswith(f"split.{n}/done"):
        return None
    return first_newer(wf.shard_upstream(stage, ds, range(n, n + 1)), output)


def newer_than_merge(set_dir: Path, job_outputs: list[str]) -> str | None:
    """The first of a set's shard job outputs (the merge rule's inputs) modified after its merged.json, or None."""
    return first_newer(job_outputs, set_dir / "merged.json")


def first_newer(inputs, output) -> str | None:
    """The first of ``inputs`` modified after ``output`` (Snakemake's trigger to rerun the job that makes it), or None;
    a missing file is no trigger here (a missing output or input is another state, said elsewhere)."""
    try:
        made = os.stat(output).st_mtime_ns
    except OSError:
        return None
    for path in inputs:
        try:
            if os.stat(path).st_mtime_ns > made:
                return path
        except OSError:
            continue
    return None


SLURM_RUN_ID = re.compile(r"SLURM run ID: (\S+)")  # the plugin's line at the start of a run


def slurm_queue(newest_logs: int = 5) -> dict[str, tuple[str, str, str]]:
    """The jobs SLURM holds for this project's recent runs: the job comment plugin 2.8.0 sets (``rule_<rule>``
    and ``_wildcards_<values>``) -> (job id, state, reason). The runs are those of the newest Snakemake logs here that
    name a ``SLURM run ID`` (the plugin names each job by it); {} without one, or when ``squeue`` is not installed
    or does not answer. A shard that waits in the queue otherwise showed as pending or stale (an HPC user's trial)."""
    runs = [m.group(1) for head in snakemake_log_heads(newest_logs) for line in head
            if (m := SLURM_RUN_ID.search(line))]
    if not runs:
        return {}
    import subprocess

    try:
        out = subprocess.run(["squeue", "--noheader", "--name", ",".join(runs), "--format", "%i|%T|%r|%k"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    jobs = [line.split("|", 3) for line in out.splitlines() if line.count("|") >= 3]
    return {comment: (job, state, reason) for job, state, reason, comment in jobs}


def queued_state(queue: dict, comment: str) -> tuple[str, str] | None:
    """(queued or running, the SLURM job) of the job with ``comment`` in ``queue`` (slurm_queue), or None."""
    if comment not in queue:
        return None
    job, state, reason = queue[comment]
    if state == "PENDING":
        return "queued", f"in SLURM job {job}, pending ({reason})"
    return "running", f"in SLURM job {job} ({state})"


def shard_job_comment(wf, stage: str, ds: str, shard: int) -> str:
    """The SLURM plugin's comment on the job that runs ``shard``: its rule (shard.smk) and wildcard values, the
    dataset and the shard or, with ``shards_per_job``, its group's first and last shard."""
    return f"rule_shard_{stage}_wildcards_" + "_".join([ds, *map(str, wf.shard_job_shards(stage, ds, shard))])


def leftover_dirs(wf) -> list[str]:
    """Dirs in the output dir that no stage or dataset of the config writes: one removed from the config or
    renamed (an HPC user's trial: nothing said so). Snakemake neither reads nor removes them."""
    owned = {Path(set_dir(wf.config, stage, ds)) for stage, ds in stage_sets(wf.config)}
    owned |= {Path(set_dir(wf.config, stage, ds))  # a training's sets: its train and valid keys
              for stage in wf.trainings for ds in wf.config["stages"][stage]["datasets"]}
    stage_dirs = {path.parent for path in owned}
    left = []
    for top in sorted(Path(wf.out).iterdir()) if Path(wf.out).is_dir() else []:
        if top.is_dir() and top not in stage_dirs:
            left.append(f"{top}/")
        elif top.is_dir():  # a stage's: its sets, its logs and its canaries' dirs
            left += [f"{sub}/" for sub in sorted(top.iterdir()) if sub.is_dir() and sub not in owned
                     and sub.name != "logs" and not sub.name.startswith(CANARY_DIR)]
    return left


def snakemake_command() -> str:
    """``snakemake`` with the profile of this project's last run (its Snakemake log's ``Command:`` line), else its
    local profile (``snakeshard init`` writes profiles/local; this repository keeps config/profiles/local), as a
    command status prints should be run (a SLURM user's trial was told to use the local one)."""
    for profile in (last_run_profile(), "profiles/local", "config/profiles/local"):
        if profile and Path(profile, "config.yaml").is_file():
            return f"snakemake --profile {profile}"
    return "snakemake --cores 1"


def last_run_profile() -> str | None:
    """The ``--profile`` of the newest Snakemake log here (its header names the command), or None."""
    for head in snakemake_log_heads(1):
        for line in head:
            if line.lstrip().startswith("Command:"):
                found = re.search(r"--profile[= ](\S+)", line)
                return found.group(1) if found else None
    return None


def snakemake_log_heads(newest: int, lines: int = 60) -> list[list[str]]:
    """The first ``lines`` lines of each of the ``newest`` Snakemake logs here (``.snakemake/log``, named by start
    time), oldest first: the header that names the command and, on SLURM, the run's id."""
    heads = []
    for path in sorted(Path(".snakemake/log").glob("*.snakemake.log"))[-newest:]:
        with open(path, errors="replace") as log:
            heads.append([line for _, line in zip(range(lines), log)])
    return heads


def print_status(wf) -> None:
    """Every set's shards (config order, as `snakeshard plan` lists them), its canary and merge, every training,
    a summary of the states, and a note when a dead driver's lock would stop the next run."""
    queue = slurm_queue()
    trainings = {stage: training_state(training) for stage, training in wf.trainings.items()}
    for stage, (state, detail) in trainings.items():  # its rule has no wildcards (train.smk)
        if state != "done" and (queued := queued_state(queue, f"rule_train_{stage}")):
            trainings[stage] = queued[0], "; ".join(filter(None, [queued[1], detail]))
    remade: dict = {}
    counts: dict[str, int] = {}
    canaries_told: set[str] = set()
    for stage, ds in stage_sets(wf.config):  # config order, as `snakeshard plan` lists them
        plan = wf.plans[stage, ds]
        base = Path(wf.out) / stage / ds
        merged = merged_state(base, wf.inputs[stage, ds])
        because = remade_because(wf, stage, ds, trainings, remade) if merged == "yes" else None
        removed = 0
        print(f"stage {stage}, dataset {ds}: {shards_text(plan['num_shards'])}")
        if stage not in canaries_told:  # the stage's canary, under the stage's first set
            canaries_told.add(stage)
            log = wf.canaries[stage]["log"]
            failure = canary_failure(stage, wf.canaries[stage], Path(log))
            if failure and merged != "yes":  # merged and current: the failure blocks nothing (a canary forced later)
                print(f"  canary: failed (log {log}): {failure}")
        feeder = wf.feeder_canaries.get((stage, ds))  # a canary over this set that a chained stage's canary reads
        if feeder and (failure := canary_failure(stage, feeder, Path(feeder["log"]))):
            print(f"  canary over this dataset (for stage {feeder['feeds']!r}'s canary): failed (log {feeder['log']}): "
                  f"{failure}")
        for shard, state, detail, deleted in set_shard_states(wf, stage, ds, merged):
            n = shard["shard"]
            shard_dir = base / f"split.{n}"
            log, output = wf.shard_job_files(stage, ds, n)
            if deleted and not because:
                # Snakemake does not rerun a removed intermediate under an up-to-date merge.
                force = "" if output.endswith(f"split.{n}/done") else "--force "
                state, detail = "removed", (f"done deleted after the merge; `{snakemake_command()} {force}{output}` "
                                            "redoes it")
                removed += 1
            elif deleted and newer_than_merge(base, [str(shard_dir / ATTEMPT_FILE)]) is None:  # not started since
                state, detail = "pending", ("done deleted after the merge; the next run redoes it, as it makes the "
                                            "merge again")
            if state != "done" and (queued := queued_state(queue, shard_job_comment(wf, stage, ds, n))):
                state, detail = queued
            counts[state] = counts.get(state, 0) + 1
            items = f"{shard['items']:>7} item{'s' if shard['items'] != 1 else ' '}"
            print(f"  split.{n:<5} {state:<10} {items}  {detail if state != 'failed' else ''}".rstrip())
            if state == "failed":
                print(f"      log {log}:\n{detail}")
        merge_log = base / MERGE_LOG
        failure = merge_failure(base, merge_log) if merged != "yes" else None
        print("  merged: " + (f"failed (log {merge_log}): {failure}" if failure
                              else f"yes, not current: snakemake makes it again ({because})" if because
                              else merged_line(merged, base, stage, bool(removed))))
    for stage, (state, detail) in trainings.items():
        counts[state] = counts.get(state, 0) + 1
        print(f"stage {stage} (training), dataset {wf.config['stages'][stage]['train']}: {state}  {detail}".rstrip())
    print("summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if left := leftover_dirs(wf):
        print(f"note: {listing(len(left), left[:MAX_LISTED])}: of no stage or "
              "dataset in the config (removed or renamed?); snakemake neither reads nor removes "
              f"{'them' if len(left) > 1 else 'it'}: rm -r when no longer needed")
    if dead_run_lock(os.getcwd(), os.getpid()):  # a trial: status said the run resumes, and it stopped on the lock
        print(f"note: {DEAD_RUN_LOCK}: the next run stops with Snakemake's LockException. If none runs here on "
              f"another machine either: {snakemake_command()} --unlock")
