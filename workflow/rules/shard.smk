# One job per shard: run the stage's runner over split.N/keys, write fragments, then done (atomically).
# A `shell:` rule, not `run:`, so a job is a plain process, not a fresh Snakemake.
# One rule per stage (`shard_<stage>`), because retries and resources are per stage; the
# rule's resources grow with `attempt` so a retry after an out-of-memory or timeout kill gets more.


def _shard_rule_functions(stage):
    """Per-stage params and resources for the rule below (a loop variable in a lambda would bind late)."""
    res = SHARD_RESOURCES[stage]

    def inputs(wildcards):
        return WF.shard_inputs_arg(stage, wildcards.dataset, int(wildcards.shard))

    def upstream(wildcards):  # a chained dataset: the upstream stage's merged output
        return WF.upstream_merged(stage, wildcards.dataset)

    def escalated(name):
        return lambda wildcards, attempt: res[name] * attempt

    resources = {name: res[name] for name in SLURM_PASSTHROUGH if name in res}  # unset ones stay unset
    resources.update(mem_mb=escalated("mem_mb"), runtime=escalated("runtime"), cpus_per_task=res["cpus_per_task"])
    return inputs, resources, upstream


for _stage in config["stages"]:
    _inputs, _resources, _upstream = _shard_rule_functions(_stage)

    rule:
        name:
            f"shard_{_stage}"
        input:
            shard_keys=f"{WF.out}/{_stage}/{{dataset}}/split.{{shard}}/keys",
            canary=ancient(f"{WF.canaries[_stage]['dir']}/done"),  # existence only: see canary.smk
            upstream=_upstream,
        output:
            done=f"{WF.out}/{_stage}/{{dataset}}/split.{{shard}}/done",
        log:
            f"{WF.out}/{_stage}/{{dataset}}/logs/split.{{shard}}.log",
        params:
            # What the shard's fingerprint digests: a change (config, model files, code, keys, their
            # records or audio) reruns the shard. The job digests it and records the parts in its done.
            inputs=_inputs,
            set_dir=f"{WF.out}/{_stage}/{{dataset}}",
        conda:
            "../envs/snakeshard.yaml"
        threads: SHARD_RESOURCES[_stage]["cpus_per_task"]
        retries: SHARD_RESOURCES[_stage]["retries"]
        resources:
            **_resources,
        shell:
            '"$SNAKESHARD_PYTHON" -m snakeshard run-shard --shard {wildcards.shard} --spec {params.set_dir}/spec.json'
            " --shard-dir {params.set_dir}/split.{wildcards.shard} --shard-inputs {params.inputs}"
            " --log {log}"
