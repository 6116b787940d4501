# Demo scoring: WER of the merged hypotheses against the dataset's transcripts (jiwer).
# A full scoring stage with mergeable metrics comes later; this is the small final step.


rule wer:
    input:
        merged=f"{WF.out}/{{stage}}/{{dataset}}/merged.json",
        ref=lambda w: WER_REPORTS[w.stage, w.dataset],
    output:
        f"{WF.out}/{{stage}}/{{dataset}}/wer.txt",
    localrule: True
    shell:
        "{PYTHON} -m snakeshard wer --hyp {WF.out}/{wildcards.stage}/{wildcards.dataset}/text"
        " --ref {input.ref} --out {output}"
