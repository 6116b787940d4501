"""Word error rate of Kaldi-style ``key text`` files, via jiwer."""

from __future__ import annotations

from snakeshard.errors import DataError


def read_text_table(path: str) -> dict[str, str]:
    table = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            key, _, text = line.rstrip("\n").partition(" ")
            if key in table:
                raise DataError(f"{path}:{line_no}: duplicate key {key!r}")
            table[key] = text.strip()
    return table


def word_error_rate(ref_path: str, hyp_path: str):
    """jiwer's word-level measures over the keys of ``ref_path``; every ref key must have a hypothesis."""
    import jiwer

    ref, hyp = read_text_table(ref_path), read_text_table(hyp_path)
    missing = [k for k in ref if k not in hyp]
    if missing:
        raise DataError(f"{hyp_path}: no hypothesis for {len(missing)} reference key(s), e.g. {missing[:5]}")
    keys = list(ref)
    return jiwer.process_words([ref[k] for k in keys], [hyp[k] for k in keys]), len(keys)


def format_wer(result, hyp_path: str, ref_path: str) -> str:
    out, n = result
    ref_words = out.hits + out.substitutions + out.deletions
    return (f"WER {out.wer * 100:.2f}% ({out.substitutions} sub, {out.deletions} del, {out.insertions} ins "
            f"of {ref_words} words, {n} utterances) hyp={hyp_path} ref={ref_path}")
