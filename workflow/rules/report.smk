# Demo scoring: WER of the merged hypotheses against the dataset's transcripts (jiwer).
# A full scoring stage with mergeable metrics comes later; this is the small final step.


rule wer:
    input:
        merged=f"{WF.out}/{{stage}}/{{dataset}}/merged.json",
        ref=lambda w: WER_REPORTS[w.stage, w.dataset],
    output:
        f"{WF.out}/{{stage}}/{{dataset}}/wer.txt",
    params:
        hyp=lambda w: f"{WF.out}/{w.stage}/{w.dataset}/text",
        set_dir=lambda w: f"{WF.out}/{w.stage}/{w.dataset}",
        inputs=lambda w: WF.inputs[w.stage, w.dataset],
    localrule: True
    script:
        "../scripts/report_wer.py"
