"""Word and character error rates from per-utterance edit operations (jiwer aligns).

The state is the corpus's sufficient statistics: substitutions, deletions, insertions, hits and the
reference length, summed over utterances; ``WER = (S + D + I) / N``. Summing integers is exact, so
the merged rate is the same for any sharding and batching, and equal to one jiwer call over every
utterance at once. Words are split on any whitespace (``str.split``); jiwer alone splits on spaces, so
a tab or newline inside a text is a word boundary here and not in a bare ``jiwer.wer`` call. An empty reference is scored as jiwer scores it: every hypothesis word is an
insertion, counted in the corpus totals, and jiwer divides by ``max(N, 1)`` (so an utterance with an
empty reference has a rate equal to its insertion count); the state counts such utterances, and
``metrics.txt`` says how many there were.

Text normalization is explicit (``TextNormalization``): named jiwer transforms applied to reference and
hypothesis alike, recorded in the state, and states normalized differently refuse to merge.
"""

from __future__ import annotations

from snakeshard.errors import ConfigError
from snakeshard.metrics.state import Metric, check_states

# Names a config may use, in the order they are written; each is a jiwer transform.
TRANSFORMS = {
    "lowercase": "ToLowerCase",
    "uppercase": "ToUpperCase",
    "remove_punctuation": "RemovePunctuation",
    "expand_contractions": "ExpandCommonEnglishContractions",
    "remove_kaldi_non_words": "RemoveKaldiNonWords",
    "remove_multiple_spaces": "RemoveMultipleSpaces",
    "strip": "Strip",
}
COUNTS = ("substitutions", "deletions", "insertions", "hits")


class TextNormalization:
    """``TextNormalization(["lowercase", "remove_punctuation"])(text)``: the jiwer transforms, in order.
    ``[]`` is a choice too (score the text as written); words are then split on whitespace.

    ``remove_punctuation`` removes exactly jiwer.RemovePunctuation's characters (Unicode category P) with
    one ``str.translate`` instead of jiwer's one ``str.replace`` per punctuation character (~800 per
    string: 80% of a scoring job's time), and without scanning all of Unicode up front.
    """

    def __init__(self, names, where: str = "normalize"):
        import jiwer

        self.check(names, where)
        self.names = list(names)
        self._steps = [_remove_punctuation if n == "remove_punctuation" else getattr(jiwer, TRANSFORMS[n])().process_string
                       for n in self.names]

    @staticmethod
    def check(names, where: str = "normalize") -> None:
        """Refuse what is not a list of known transform names (without importing jiwer: the parse calls it)."""
        if not isinstance(names, (list, tuple)):
            raise ConfigError(f"{where}: a list of text transforms ({', '.join(TRANSFORMS)}), or [] for none; "
                              f"got {names!r}")
        unknown = [n for n in names if n not in TRANSFORMS]
        if unknown:
            raise ConfigError(f"{where}: unknown text transform {unknown[0]!r} (known: {', '.join(TRANSFORMS)})")

    def __call__(self, text: str) -> str:
        for step in self._steps:
            text = step(text)
        return text


class _PunctuationTable(dict):
    """A ``str.translate`` table that deletes Unicode punctuation, filled in as characters are first seen."""

    def __missing__(self, codepoint: int):
        import unicodedata

        self[codepoint] = None if unicodedata.category(chr(codepoint)).startswith("P") else codepoint
        return self[codepoint]


_PUNCTUATION = _PunctuationTable()


def _remove_punctuation(text: str) -> str:
    return text.translate(_PUNCTUATION)


def utterance_counts(ref: str, hyp: str, unit: str = "word") -> tuple[dict, list]:
    """jiwer's edit operations for one normalized pair: ``({substitutions, deletions, insertions, hits},
    alignment)``; the alignment is ``[(op, ref_token, hyp_token)]`` with op C/S/D/I and ``None`` for a
    missing token (sclite's ``***``)."""
    import jiwer

    identity = jiwer.Compose([])
    if unit == "word":
        ref_tokens, hyp_tokens = ref.split(), hyp.split()
    else:  # characters, spaces included, as jiwer.cer counts them (after its strip)
        ref_tokens, hyp_tokens = list(ref.strip()), list(hyp.strip())
    out = jiwer.process_words([ref_tokens], [hyp_tokens], reference_transform=identity, hypothesis_transform=identity)
    counts = {name: getattr(out, name) for name in COUNTS}
    alignment = []
    for chunk in out.alignments[0]:
        refs = ref_tokens[chunk.ref_start_idx:chunk.ref_end_idx]
        hyps = hyp_tokens[chunk.hyp_start_idx:chunk.hyp_end_idx]
        if chunk.type == "insert":
            alignment += [("I", None, h) for h in hyps]
        elif chunk.type == "delete":
            alignment += [("D", r, None) for r in refs]
        else:
            op = "C" if chunk.type == "equal" else "S"
            alignment += [(op, r, h) for r, h in zip(refs, hyps)]
    return counts, alignment


class ErrorRate(Metric):
    """Corpus error rate over words (``unit="word"``: WER) or characters (``"char"``: CER)."""

    name = "error_rate"
    unit = "word"

    def __init__(self, normalize=(), *, unit: str | None = None):
        self.unit = unit or type(self).unit
        self.normalization = normalize if isinstance(normalize, TextNormalization) else TextNormalization(list(normalize))
        self.totals = dict.fromkeys(COUNTS, 0)
        self.utterances = 0
        self.empty_references = 0

    def update(self, refs, hyps) -> list[dict]:
        """Add pairs of raw texts (normalized here); returns each pair's counts and alignment."""
        if isinstance(refs, str) or isinstance(hyps, str):
            raise TypeError(f"{type(self).__name__}.update takes lists of texts (one per utterance), not a string")
        if len(refs) != len(hyps):
            raise ValueError(f"{type(self).__name__}.update: {len(refs)} references but {len(hyps)} hypotheses")
        scored = []
        for ref, hyp in zip(refs, hyps):
            ref, hyp = self.normalization(ref), self.normalization(hyp)
            counts, alignment = utterance_counts(ref, hyp, self.unit)
            self.add(counts)
            scored.append({**counts, "reference_length": _length(counts), "alignment": alignment})
        return scored

    def add(self, counts: dict) -> None:
        """Add one utterance's counts (as ``utterance_counts`` gives them)."""
        for name in COUNTS:
            self.totals[name] += counts[name]
        self.utterances += 1
        self.empty_references += _length(counts) == 0

    def state(self) -> dict:
        return {"type": type(self).__name__, "unit": self.unit, "normalize": self.normalization.names,
                **self.totals, "utterances": self.utterances, "empty_references": self.empty_references}

    @classmethod
    def merge(cls, states):
        states = check_states(cls, states, same=("unit", "normalize"))
        merged = cls(states[0]["normalize"], unit=states[0]["unit"])
        for state in states:
            for name in COUNTS:
                merged.totals[name] += state[name]
            merged.utterances += state["utterances"]
            merged.empty_references += state["empty_references"]
        return merged

    def compute(self) -> dict:
        errors = sum(self.totals[n] for n in ("substitutions", "deletions", "insertions"))
        length = _length(self.totals)
        # jiwer's own rule: an all-empty reference set divides by 1 (its errors are insertions)
        return {self.name: errors / max(length, 1), **self.totals, "reference_length": length,
                "utterances": self.utterances, "empty_references": self.empty_references}

    def summary(self) -> str:
        """``WER 22.83% (15 sub, 3 del, 3 ins of 92 words, 10 utterances)``."""
        return summary_line(self.name, self.compute())


def summary_line(name: str, value: dict) -> str:
    """One line for an error rate's ``compute()`` value (``name``: wer or cer), as metrics.txt shows it."""
    def counted(n: int, noun: str) -> str:
        return f"{n} {noun}{'' if n == 1 else 's'}"

    unit = "word" if name == "wer" else "character"
    return (f"{name.upper()} {100 * value[name]:.2f}% ({value['substitutions']} sub, {value['deletions']} del, "
            f"{value['insertions']} ins of {counted(value['reference_length'], unit)}, "
            f"{counted(value['utterances'], 'utterance')})")


def _length(counts: dict) -> int:
    return counts["hits"] + counts["substitutions"] + counts["deletions"]


class WordErrorRate(ErrorRate):
    name, unit = "wer", "word"


class CharacterErrorRate(ErrorRate):
    name, unit = "cer", "char"
