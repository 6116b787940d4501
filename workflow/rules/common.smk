# Parse-time setup: validate the config, plan every stage/dataset (cached in plan.json),
# compute fingerprints. The shard count must be known here so `snakemake -n` lists every shard job.
import os
import sys
from pathlib import Path

# Runner/provider modules next to the project's Snakefile are importable, as they are in shard
# jobs (`python -m snakeshard` puts the working directory on sys.path).
if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())

from snakeshard.core.user_source import runner_reports
from snakeshard.errors import NOTE_PREFIX
from snakeshard.workflow import snakemake_patches
from snakeshard.workflow.config_file import check_duplicate_keys
from snakeshard.workflow.parse import (SLURM_PASSTHROUGH, Workflow, exit_on_user_error, ignored_key_notes, shard_stages,
                                       stage_resources, stage_sets, validate_config)
from snakeshard.workflow.run_lock import stale_lock_note

# Three costs of Snakemake 9's driver: a scheduler wake-up per second per finished job, a pandas import
# when the first job ends, which holds up the next, and every ready job's inputs stat'ed again before
# every scheduling pass (see the module and docs/upstream/). Only on the Snakemake versions they were
# checked against; on another, one line per patch says it is left out (in the main process only, not
# in every SLURM job's log).
snakemake_patches.apply(note=workflow.is_main_process)

# A bad config or bad data: its one `snakeshard: error:` line, no traceback of snakeshard's code, exit 1.
with exit_on_user_error():
    if workflow.is_main_process:  # a key set twice in a config file: YAML drops the first silently
        check_duplicate_keys(workflow.configfiles)
    # Found next to this file, so the workflow works as a module from any directory.
    validate_config(config, Path(str(workflow.current_basedir)).parent / "schemas" / "config.schema.yaml")
    # A job's own Snakemake (SLURM) takes the audio identity the main process computed, rather than
    # stat'ing every audio file of the dataset again in every job.
    WF = Workflow(config, reuse_audio_identity=not workflow.is_main_process)
    STAGE_SETS = stage_sets(config)  # sharded and merged (a training stage's sets are planned, then trained on)
    SHARD_STAGES = shard_stages(config)
    SHARD_RESOURCES = {stage: stage_resources(config, stage) for stage in config["stages"]}
    # Files a stage's runner draws after its merge for `snakemake --report` (ScoringRunner: metrics.png).
    REPORTS = {stage: runner_reports(config["stages"][stage]["runner"], f"stages.{stage}") for stage in SHARD_STAGES}

# A fingerprint_ignore key that looks misspelt, a Kaldi dir's text line with no recording: said by the driver (not in
# every SLURM job's log).
if workflow.is_main_process:
    for _note in ignored_key_notes(config) + WF.data_notes():
        print(_note, file=sys.stderr, flush=True)

# A merged file deleted after its merge (merged.json still listing it): forget that merge, so that this run merges
# the set again from its shards rather than calling it up to date and failing later in the stage that reads it.
if workflow.is_main_process:
    from snakeshard.core.merge import forget_incomplete_merge

    for _stage, _ds in STAGE_SETS:
        _missing = forget_incomplete_merge(f"{WF.out}/{_stage}/{_ds}")
        if _missing:
            print(f"{NOTE_PREFIX}{WF.out}/{_stage}/{_ds}: merged file(s) {', '.join(_missing)} missing: its "
                  "merged.json is removed, and the set is merged again from its shards", file=sys.stderr, flush=True)

# A lock a dead driver left (kill -9): Snakemake checks its locks after this parse and stops with a LockException
# that cannot tell a live run from a dead one. Its lock files name paths, not a process; when no other snakemake
# runs in this directory, say so, with the command that clears it (printed before Snakemake's own error).
if workflow.is_main_process:
    _lock_note = stale_lock_note(os.getcwd(), sys.argv[1:], os.getpid())
    if _lock_note:
        print(_lock_note, file=sys.stderr, flush=True)

# The interpreter running Snakemake also runs the jobs: no reliance on PATH inside jobs. It reaches
# the shell commands through the environment (jobs inherit it; on SLURM the job's own Snakemake
# parses this file again), not through a name in the command: a module's names are not visible
# there, and the command's text is what Snakemake's code trigger compares.
os.environ["SNAKESHARD_PYTHON"] = sys.executable


wildcard_constraints:
    stage=r"[^/]+",
    dataset=r"[^/]+",
    shard=r"\d+",
    first=r"\d+",
    last=r"\d+",
