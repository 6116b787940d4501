# snakeshard: plan shards from the data, run one job per shard, merge and validate.
# Kept cheap to parse (it is parsed again inside every SLURM job): no heavy imports here.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/shard.smk"
include: "workflow/rules/merge.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        [f"{WF.out}/{stage}/{ds}/merged.json" for stage, ds in STAGE_SETS],
        [f"{WF.out}/{stage}/{ds}/wer.txt" for stage, ds in STAGE_SETS if WER_REPORTS.get((stage, ds))],
    default_target: True
