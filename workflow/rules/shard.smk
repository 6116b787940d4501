# One job per shard: run the stage's runner over split.N/keys, write fragments, then done (atomically).
# A `shell:` rule, not `run:`, so a job is a plain process, not a fresh Snakemake.


rule shard:
    input:
        shard_keys=f"{WF.out}/{{stage}}/{{dataset}}/split.{{shard}}/keys",
    output:
        done=f"{WF.out}/{{stage}}/{{dataset}}/split.{{shard}}/done",
    log:
        f"{WF.out}/{{stage}}/{{dataset}}/logs/split.{{shard}}.log",
    params:
        # A changed fingerprint (config, model files, keys) reruns the shard.
        fingerprint=lambda w: WF.shard_fps[w.stage, w.dataset][int(w.shard)],
    conda:
        "../../envs/snakeshard.yaml"
    threads: lambda w: stage_resources(config, w.stage)["cpus_per_task"]
    resources:
        mem_mb=lambda w: stage_resources(config, w.stage)["mem_mb"],
        runtime=lambda w: stage_resources(config, w.stage)["runtime"],
    shell:
        "{PYTHON} -m snakeshard run-shard --shard {wildcards.shard}"
        " --spec {WF.out}/{wildcards.stage}/{wildcards.dataset}/spec.json"
        " --shard-dir {WF.out}/{wildcards.stage}/{wildcards.dataset}/split.{wildcards.shard}"
        " --fingerprint {params.fingerprint} --log {log} > {log} 2>&1"
