# Training stages: one job per stage over every key of its train (and valid) dataset (snakeshard/train/stage.py).
# Its declared outputs (model.pt, metrics.json, curve.png) are written when training ends, done last.
# checkpoints/ and steps.jsonl are not declared: Snakemake keeps them when the job fails (a signal, a time limit,
# kill -9), and the rerun, or the rule's own retry, resumes from the latest checkpoint.
# A job stopped by SIGTERM or SIGUSR1 checkpoints at the next step and exits non-zero; on SLURM the rule asks for
# SIGTERM `checkpoint.signal_seconds` before the time limit (sbatch --signal), so a retry (`retries`, with a longer
# runtime) resumes where the time limit would have cut it.


for _stage, _training in WF.trainings.items():
    _resources = dict(_shard_rule_functions(_stage).resources)
    _signal = f"--signal=TERM@{WF.signal_seconds(_stage)}"
    _resources["slurm_extra"] = f"{_resources['slurm_extra']} {_signal}" if "slurm_extra" in _resources else _signal

    rule:
        name:
            f"train_{_stage}"
        input:
            plan_keys=_training["keys"],  # the train and valid keys: rewritten by the parse when they change
            upstream=_training["upstream"],  # chained datasets' and the stats' merged.json
        output:
            model=f"{_training['dir']}/model.pt",
            metrics=f"{_training['dir']}/metrics.json",
            curve=report(f"{_training['dir']}/curve.png", category=_stage, subcategory="training"),
            done=f"{_training['dir']}/done",
        log:
            f"{_training['dir']}/logs/train.log",
        params:
            # config (less checkpoint), code, keys, records, audio and upstream merges: a change retrains
            fingerprint=_training["fingerprint"],
            spec=_training["spec"],
        threads: SHARD_RESOURCES[_stage]["cpus_per_task"]
        retries: SHARD_RESOURCES[_stage]["retries"]
        resources:
            **_resources,
        shell:
            '"$SNAKESHARD_PYTHON" -m snakeshard train --spec {params.spec:q} --fingerprint {params.fingerprint:q}'
            " --log {log:q}"
