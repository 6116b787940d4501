"""`script:` entry point of the demo's `wer` rule: score merged hypotheses against the dataset's text."""

from snakeshard.atomic import atomic_write_text
from snakeshard.merge import require_current
from snakeshard.wer import format_wer, word_error_rate

snakemake = globals()["snakemake"]  # injected by Snakemake's script: directive
hyp, ref = snakemake.params.hyp, snakemake.input.ref
require_current(snakemake.params.set_dir, snakemake.params.inputs)  # never score a stale merge
line = format_wer(word_error_rate(ref, hyp), hyp, ref)
print(line)
atomic_write_text(snakemake.output[0], line + "\n")
