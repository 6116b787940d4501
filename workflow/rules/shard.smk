# One job per shard: run the stage's runner over split.N/keys, write fragments, then done (atomically).
# A `shell:` rule, not `run:`, so a job is a plain process, not a fresh Snakemake.
# One rule per stage (`shard_<stage>`), because retries and resources are per stage; the
# rule's resources grow with `attempt` so a retry after an out-of-memory or timeout kill gets more.
# A stage with `shards_per_job: K` gets, under the same rule name, one job per K consecutive shards
# (`run-shards`): its output is jobs/shards.FIRST-LAST.done, each shard still writes split.N/done.
# Every value a command line holds is quoted ({...:q}), here and in the other rules: output_dir may hold
# spaces, quotes, `$()` or `;` (workflow.parse.check_output_dir), and it starts every path the rules name.

from types import SimpleNamespace

from snakeshard.core.shard_files import KEYS_FILE, SHARD_FINGERPRINT


def _shard_rule_functions(stage):
    """Per-stage params and resources for the rules below (a loop variable in a lambda would bind late)."""
    res = SHARD_RESOURCES[stage]

    def inputs(wildcards):
        return WF.shard_inputs_arg(stage, wildcards.dataset, int(wildcards.shard))

    def group_files(name):
        return lambda wildcards: [f"{WF.out}/{stage}/{wildcards.dataset}/split.{n}/{name}"
                                  for n in range(int(wildcards.first), int(wildcards.last) + 1)]

    def group_inputs(wildcards):
        return ",".join(WF.shard_inputs_arg(stage, wildcards.dataset, n)
                        for n in range(int(wildcards.first), int(wildcards.last) + 1))

    def upstream(wildcards):  # a chained dataset's upstream shards over this shard's keys (not the whole merge)
        return WF.shard_upstream(stage, wildcards.dataset, [int(wildcards.shard)])

    def group_upstream(wildcards):
        return WF.shard_upstream(stage, wildcards.dataset, range(int(wildcards.first), int(wildcards.last) + 1))

    def job_inputs(keys, fingerprint, canary, upstream):
        # The fingerprint file (see parse.write_shard_fingerprint): a shard whose fingerprint changed reruns by mtime,
        # also where Snakemake has no record of its done's params. The upstream input only for a stage that has one
        # (chained datasets, a trained model): Snakemake's DAG calls an input function once a job, 0.05-0.1 s of a
        # warm `snakemake -n` at 1,000 shards (bench/RESULTS.md 29).
        return {"shard_keys": keys, "fingerprint": fingerprint, "canary": canary,
                **({"upstream": upstream} if WF.waits_upstream(stage) else {})}

    def escalated(name):
        return lambda wildcards, attempt: res[name] * attempt

    def group_runtime(wildcards, attempt):  # the shards of a job run one after the other
        return res["runtime"] * attempt * (int(wildcards.last) - int(wildcards.first) + 1)

    resources = {name: res[name] for name in SLURM_PASSTHROUGH if name in res}  # unset ones stay unset
    resources.update(mem_mb=escalated("mem_mb"), runtime=escalated("runtime"), cpus_per_task=res["cpus_per_task"])
    return SimpleNamespace(inputs=inputs, resources=resources, upstream=upstream, group_upstream=group_upstream,
                           group_keys=group_files(KEYS_FILE), group_fingerprints=group_files(SHARD_FINGERPRINT),
                           job_inputs=job_inputs,
                           group_inputs=group_inputs, group_resources={**resources, "runtime": group_runtime})


for _stage in [stage for stage in SHARD_STAGES if not WF.grouped(stage)]:
    _f = _shard_rule_functions(_stage)

    rule:
        name:
            f"shard_{_stage}"
        input:
            # see canary.smk for the canary
            **_f.job_inputs(f"{WF.out}/{_stage}/{{dataset}}/split.{{shard}}/{KEYS_FILE}",
                            f"{WF.out}/{_stage}/{{dataset}}/split.{{shard}}/{SHARD_FINGERPRINT}",
                            f"{WF.canaries[_stage]['dir']}/done", _f.upstream),
        output:
            done=f"{WF.out}/{_stage}/{{dataset}}/split.{{shard}}/done",
        log:
            f"{WF.out}/{_stage}/{{dataset}}/logs/split.{{shard}}.log",
        params:
            # What the shard's fingerprint digests: a change (config, model files, code, keys, their
            # records or audio) reruns the shard. The job digests it and records the parts in its done.
            inputs=_f.inputs,
            set_dir=f"{WF.out}/{_stage}/{{dataset}}",
        conda:
            "../envs/snakeshard.yaml"
        threads: SHARD_RESOURCES[_stage]["cpus_per_task"]
        retries: SHARD_RESOURCES[_stage]["retries"]
        resources:
            **_f.resources,
        shell:
            '"$SNAKESHARD_PYTHON" -m snakeshard run-shard --shard {wildcards.shard:q} --spec {params.set_dir:q}/spec.json'
            " --shard-dir {params.set_dir:q}/split.{wildcards.shard:q} --shard-inputs {params.inputs:q}"
            " --log {log:q}"


for _stage in [stage for stage in SHARD_STAGES if WF.grouped(stage)]:
    _f = _shard_rule_functions(_stage)

    rule:
        name:
            f"shard_{_stage}"
        input:
            **_f.job_inputs(_f.group_keys, _f.group_fingerprints, f"{WF.canaries[_stage]['dir']}/done",
                            _f.group_upstream),
        output:
            done=f"{WF.out}/{_stage}/{{dataset}}/jobs/shards.{{first}}-{{last}}.done",
        log:
            f"{WF.out}/{_stage}/{{dataset}}/logs/shards.{{first}}-{{last}}.log",
        params:
            inputs=_f.group_inputs,  # every shard's, comma-separated: a change of any reruns the job (and only that shard)
            set_dir=f"{WF.out}/{_stage}/{{dataset}}",
        conda:
            "../envs/snakeshard.yaml"
        threads: SHARD_RESOURCES[_stage]["cpus_per_task"]
        retries: SHARD_RESOURCES[_stage]["retries"]
        resources:
            **_f.group_resources,
        shell:
            '"$SNAKESHARD_PYTHON" -m snakeshard run-shards --shards {wildcards.first:q}-{wildcards.last:q}'
            " --spec {params.set_dir:q}/spec.json --set-dir {params.set_dir:q} --shard-inputs {params.inputs:q}"
            " --done {output.done:q} --log {log:q}"
