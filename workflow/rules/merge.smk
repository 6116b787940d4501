# Merge (local): refuse unless every planned shard is done with the expected fingerprint,
# then concatenate fragments in plan order; merged.json is written last. summary.html (shards, items, audio
# hours, compute time and real-time factor, per shard too) is what `snakemake --report` shows of the set.


from snakeshard.core.shard_files import MERGE_LOG


rule merge:
    input:
        lambda w: WF.job_done_files(w.stage, w.dataset),
    output:
        merged=f"{WF.out}/{{stage}}/{{dataset}}/merged.json",
        summary=report(f"{WF.out}/{{stage}}/{{dataset}}/summary.html", category="{stage}", subcategory="{dataset}"),
    log:
        f"{WF.out}/{{stage}}/{{dataset}}/{MERGE_LOG}",
    params:
        # any change of a shard's inputs (or the stage) reruns the merge; the merge checks it against fingerprints.json
        inputs=lambda w: WF.inputs[w.stage, w.dataset],
        set_dir=f"{WF.out}/{{stage}}/{{dataset}}",
    localrule: True
    shell:
        '"$SNAKESHARD_PYTHON" -m snakeshard merge --spec {params.set_dir:q}/spec.json --set-dir {params.set_dir:q}'
        " --inputs {params.inputs:q} --log {log:q}"
