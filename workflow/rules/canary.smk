# The canary: one job per stage that runs the stage's runner over the first few keys of its first
# dataset before any of its shard jobs is scheduled, so a broken stage (a provider that lacks an env
# name forward asks for, a result the writers refuse) fails once, in one job, with one message,
# instead of in every shard job (on SLURM: N submitted jobs). `canary: N` keys, per stage or at the
# top level (0: off); on by default (workflow.parse.DEFAULT_CANARY), with every profile.
#
# Why it is shaped like this: Snakemake skips its own rerun checks (params, keys) for every job
# downstream of a job that has to run, so a canary rerun must never happen unless all of the stage's
# shards rerun too. Hence its output lives under the stage fingerprint (`_canary/<fp>/done`, a new
# path exactly when every shard's fingerprint changes), it has no input, params or command that
# change otherwise. Shard jobs take it as a plain input, not through ancient(): a canary that has to run
# while its done exists (after a driver killed mid-canary, --rerun-incomplete forces it) masks every
# job below it from Snakemake's own checks, and an ancient() input that exists stops the walk down from
# it, so the rerun ran the canary alone and ended "1 of 1 steps done" with every shard still missing.
# As a plain input, a canary rerun reruns the stage's shards; it reruns only when they do anyway (a new
# fingerprint), or when asked to (--forcerun, its done deleted). A canary over a chained dataset takes the upstream
# stage's canary output (its keys, its done as input), not the upstream merge: the merge reruns with any upstream
# shard, the upstream canary only when all of them do. Turning the canary on or off changes
# only its keys file, so it never reruns finished shards; with `canary: 0` the job writes its done
# without building anything.


# A stage's canary, and a canary of a stage over another of its datasets that a chained stage's canary reads (its
# output is that canary's input; WF.feeder_canaries).
for _canary in [*WF.canaries.values(), *WF.feeder_canaries.values()]:
    _stage = _canary["stage"]
    _resources = _shard_rule_functions(_stage).resources  # the shard jobs' resources (and, below, retries)

    rule:
        name:
            _canary["rule"]
        input:
            # a canary over a chained dataset reads the upstream canary's output; an inference stage's, the model
            _canary["upstream"],
        output:
            done=f"{_canary['dir']}/done",
        log:
            _canary["log"],
        params:
            spec=_canary["spec"],
            shard_dir=_canary["dir"],
            fingerprint=_canary["fingerprint"],
        localrule: not _canary["items"]
        threads: SHARD_RESOURCES[_stage]["cpus_per_task"]
        retries: SHARD_RESOURCES[_stage]["retries"]
        resources:
            **_resources,
        shell:
            '"$SNAKESHARD_PYTHON" -m snakeshard run-shard --shard canary --spec {params.spec:q}'
            " --shard-dir {params.shard_dir:q} --fingerprint {params.fingerprint:q} --log {log:q}"
            + (f" --feeds {_canary['feeds']}" if _canary["feeds"] else "")
