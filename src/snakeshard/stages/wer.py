"""``snakeshard wer``: the word (and character) error rate of a Kaldi-style ``key text`` hypothesis file against a
reference."""

from __future__ import annotations

from snakeshard.core.data import unique_kaldi_table
from snakeshard.errors import DataError


def read_text_table(path: str) -> dict[str, str]:
    """A ``key text`` file read as a dataset's Kaldi ``text`` is (space or tab after the key; a blank line, a
    byte-order mark or a repeated key named): a user trial's tab-separated reference was blamed on the hypothesis
    file."""
    return {key: text for key, text, _ in unique_kaldi_table(path)}


def error_rates(ref_path: str, hyp_path: str, normalize=(), units=("word",)):
    """An ``ErrorRate`` per unit (``word``: WER, ``char``: CER) over the keys of ``ref_path``; every reference
    key needs a hypothesis and every hypothesis a reference (a key on one side only is an error naming it,
    never skipped)."""
    from snakeshard.metrics import CharacterErrorRate, WordErrorRate

    ref, hyp = read_text_table(ref_path), read_text_table(hyp_path)
    for keys, path, other in ((ref, hyp_path, hyp), (hyp, ref_path, ref)):
        missing = [k for k in keys if k not in other]
        if missing:
            raise DataError(f"{path}: no line for key {missing[0]!r}" +
                            (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    metrics = [{"word": WordErrorRate, "char": CharacterErrorRate}[unit](normalize) for unit in units]
    for metric in metrics:
        metric.update([ref[k] for k in ref], [hyp[k] for k in ref])
    return metrics
