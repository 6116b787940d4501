# Reports: what a stage's runner draws from its merged output (ScoringRunner: metrics.png), registered
# so `snakemake --report report.html` shows it. Drawn locally, after the merge, from the current merge only.


rule report:
    input:
        f"{WF.out}/{{stage}}/{{dataset}}/merged.json",
    output:
        report(f"{WF.out}/{{stage}}/{{dataset}}/{{name}}.png", category="{stage}", subcategory="{dataset}"),
    params:
        inputs=lambda w: WF.inputs[w.stage, w.dataset],
        set_dir=f"{WF.out}/{{stage}}/{{dataset}}",
    localrule: True
    shell:
        '"$SNAKESHARD_PYTHON" -m snakeshard report --spec {params.set_dir:q}/spec.json --set-dir {params.set_dir:q}'
        " --inputs {params.inputs:q} --output {output:q}"
