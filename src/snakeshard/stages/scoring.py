"""Scoring as a stage: per-key scores and alignments as fields, corpus metrics merged exactly.

``provider_config``:
  metrics: [wer, cer]        any of wer, cer (text), classification, regression (additive: sufficient
                             statistics per shard, summed at merge), auroc, auprc, eer, min_dcf (need
                             every score: computed once at merge from the merged per-key fields)
  hypothesis: text           the field scored: the upstream stage's field over a chained dataset
                             ({from_stage: asr, dataset: demo}), else a field of the dataset itself
  reference: text            a field of the dataset (a Kaldi dir's ``text``; any JSON Lines field)
  normalize: [lowercase, remove_punctuation]   for wer/cer, required: jiwer transforms applied to both
                             sides ([] scores the text as written); recorded in metrics.json/.txt
  group_by: spk              optional: additive metrics per value of this dataset field (``spk`` is
                             a Kaldi dir's utt2spk), as sclite reports per speaker
  p_target, c_miss, c_fa     minDCF's prior and costs (0.01, 1, 1)

Per shard: fields ``scores`` (JSON Lines: per metric the key's counts), ``alignment`` (JSON Lines,
words: ops C/S/D/I with both token lists, null for a missing token), ``prediction``/``target`` (text,
for classification, regression and the score metrics), ``group``; the state file ``metric_state.json``.
The merge writes ``metrics.json`` (values, sufficient statistics, what was scored and how) and
``metrics.txt`` (sclite-like); the workflow draws ``metrics.png`` for ``snakemake --report``.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path

from snakeshard import BaseRunner, InferenceProvider
from snakeshard.core.data import StageOutputDataset, source_spec
from snakeshard.errors import ConfigError, DataError, MergeError
from snakeshard.metrics import CharacterErrorRate, ConfusionMatrix, RegressionMetrics, TextNormalization, WordErrorRate
from snakeshard.stages.scoring_fields import TEXT_METRICS, binary_label, merged_pairs
from snakeshard.stages.scoring_report import metrics_text, plot_metrics

ADDITIVE_METRICS = (*TEXT_METRICS, "classification", "regression")
SCORE_METRICS = ("auroc", "auprc", "eer", "min_dcf")  # BinaryScores: need every key's score at once
ADDITIVE = {"wer": WordErrorRate, "cer": CharacterErrorRate, "classification": ConfusionMatrix,
            "regression": RegressionMetrics}  # text metrics take the normalization
STATE_FILE = "metric_state.json"
METRICS_JSON, METRICS_TXT = "metrics.json", "metrics.txt"
WHERE = "stages.<stage>.provider_config"
DCF_DEFAULTS = {"p_target": 0.01, "c_miss": 1.0, "c_fa": 1.0}  # min_dcf's target prior and costs


class Scoring:
    """What a scoring stage measures, from its ``provider_config`` (validated, errors name the key)."""

    def __init__(self, config: dict, where: str = WHERE):
        self.check(config, where)
        self.metrics = list(dict.fromkeys(config["metrics"]))
        # what forward does per key, decided once
        self.text_metrics = [m for m in self.metrics if m in TEXT_METRICS]
        self.scores = any(m in SCORE_METRICS for m in self.metrics)
        self.pairs = "regression" in self.metrics or "classification" in self.metrics or self.scores
        self.hypothesis = config.get("hypothesis", "text")
        self.reference = config.get("reference", "text")
        self.group_by = config.get("group_by")
        self.normalize = None
        if self.text_metrics:
            self.normalize = TextNormalization(config["normalize"], f"{where}.normalize")
        self.dcf = {k: float(config.get(k, default)) for k, default in DCF_DEFAULTS.items()}

    @staticmethod
    def check(config: dict, where: str = WHERE) -> None:
        """Refuse a provider_config that names no metric, an unknown one, text metrics without a normalization or
        an unknown transform, or a cost that is no number; errors name ``where``'s key. Imports nothing: the parse
        calls it (``ScoringProvider.check_config``), so that `snakemake -n` says it rather than the canary."""
        unknown = sorted(set(config) - {*ScoringProvider.config_keys, "dataset", "devices"})
        if unknown:  # in process (the parse refuses these in a workflow)
            raise ConfigError(f"{where}.{unknown[0]}: not a scoring option ({', '.join(ScoringProvider.config_keys)})")
        metrics = config.get("metrics")
        known = (*ADDITIVE_METRICS, *SCORE_METRICS)
        if not metrics or not isinstance(metrics, list):
            raise ConfigError(f"{where}.metrics: a list of metrics to compute ({', '.join(known)})")
        bad = [m for m in metrics if m not in known]
        if bad:
            close = difflib.get_close_matches(str(bad[0]), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}.metrics: unknown metric {bad[0]!r}{hint}; known: {', '.join(known)}")
        if any(m in TEXT_METRICS for m in metrics):
            if "normalize" not in config:
                raise ConfigError(f"{where}.normalize: wer and cer need an explicit text normalization: a list of "
                                  "jiwer transforms (e.g. [lowercase, remove_punctuation]), or [] to score the "
                                  "text as written")
            TextNormalization.check(config["normalize"], f"{where}.normalize")
        for key in DCF_DEFAULTS:
            if key in config and (isinstance(config[key], bool) or not isinstance(config[key], (int, float))):
                raise ConfigError(f"{where}.{key}: a number (default {DCF_DEFAULTS[key]}), got {config[key]!r}")
        if not 0 < config.get("p_target", DCF_DEFAULTS["p_target"]) < 1:  # p_target 1.5 printed minDCF 1.0, rc 0
            raise ConfigError(f"{where}.p_target: the prior of a target, between 0 and 1 (exclusive), got "
                              f"{config['p_target']!r}")
        for key in ("c_miss", "c_fa"):
            if config.get(key, 1) <= 0:
                raise ConfigError(f"{where}.{key}: a cost, above 0, got {config[key]!r}")
        if "normalize" in config and not any(m in TEXT_METRICS for m in metrics):  # a user trial: [lowercase] left
            raise ConfigError(f"{where}.normalize: a normalization of wer and cer text, and metrics {metrics} holds "
                              "neither: class labels are compared as written")     # "b" and "B" two classes, silently
        if config.get("group_by") is not None and not any(m in ADDITIVE_METRICS for m in metrics):
            raise ConfigError(f"{where}.group_by: per-group values are computed for {', '.join(ADDITIVE_METRICS)}; "
                              f"{', '.join(metrics)} are computed over the whole set only")

    def describe(self) -> dict:
        """The part recorded in every state file and in metrics.json."""
        return {"metrics": self.metrics, "hypothesis": self.hypothesis, "reference": self.reference,
                "normalize": self.normalize.names if self.normalize else None, "group_by": self.group_by,
                **({"dcf": self.dcf} if self.scores else {})}

    def new_metrics(self) -> dict:
        """A fresh accumulator per additive metric."""
        return {m: ADDITIVE[m](self.normalize) if m in TEXT_METRICS else ADDITIVE[m]()
                for m in self.metrics if m in ADDITIVE}


class ScoringProvider(InferenceProvider):
    """The dataset (chained or not) and the ``Scoring`` its provider_config describes."""

    config_keys = ("metrics", "hypothesis", "reference", "normalize", "group_by", "p_target", "c_miss", "c_fa")

    @staticmethod
    def check_config(config: dict, where: str) -> None:
        Scoring.check(config, where)

    def build_env(self) -> dict:
        from snakeshard.core.data import load_dataset

        scoring = Scoring(self.config)
        return {"dataset": load_dataset(self.config["dataset"]), "scoring": scoring}


def _value(dataset, key: str, field: str, what: str) -> str:
    """The hypothesis (an upstream field over a chained dataset, else a dataset field) or the reference."""
    if what == "hypothesis" and isinstance(dataset, StageOutputDataset):
        return dataset.load_field(key, field)
    record = dataset[key]
    value = record.get(field)
    if value is None and field in record:  # JSON null (a user trial: said "no field")
        raise DataError(f"item {key!r}: its {what} field {field!r} is null ({WHERE}.{what})")
    if value is None:
        # a chained dataset's records are its source dataset's: name that file (a trial: it said "the source dataset")
        place = source_spec(dataset.spec).get("path", "the source dataset")
        raise DataError(f"item {key!r}: no {what}: the dataset ({place}) has no field {field!r} for it "
                        f"({WHERE}.{what}; a Kaldi dir gives text and spk (utt2spk), JSON Lines its own fields)")
    return value


# A field's value as each metric reads it, checked per key: a JSON Lines field may hold any JSON value, and str() of
# one scored it silently (a user trial: a token list scored as "['the', 'cat']", 1 and 1.0 as two classes).

def _text(key: str, value, what: str) -> str:
    if isinstance(value, str):
        return value
    raise DataError(f"item {key!r}: {what} holds {value!r} (a {type(value).__name__}), not text: wer and cer score "
                    "strings (a token list: join it with spaces first)")


def _label(key: str, value, what: str) -> str:
    """A class label: a string as written (stripped), a whole JSON number as that integer (1 and 1.0 are one class,
    as for scikit-learn)."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        return str(int(value))
    raise DataError(f"item {key!r}: {what} holds {value!r}, not a class label: a string, or a whole number")


def _number(key: str, value, what: str) -> float:
    """A finite number (a JSON number, or text that reads as one); true/false and NaN are refused, naming the key."""
    if not isinstance(value, bool):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if math.isfinite(number):
            return number
    raise DataError(f"item {key!r}: {what} holds {value!r}, not a finite number")


class ScoringRunner(BaseRunner):
    """Scores each key, keeps additive metrics' sufficient statistics as the shard's state, merges them."""

    # Scoring costs tens of microseconds per key: big shards, so job start-up does not dominate.
    default_sharding = {"shard_size": 50000}
    reports = ("metrics.png",)  # drawn after the merge by the workflow's report rule, for snakemake --report

    @staticmethod
    def forward(keys, *, dataset, scoring):
        from snakeshard.metrics.text import utterance_counts

        results = []
        for key in keys if isinstance(keys, list) else [keys]:
            hyp = _value(dataset, key, scoring.hypothesis, "hypothesis")
            ref = _value(dataset, key, scoring.reference, "reference")
            result = {"key": key}
            hyp_is, ref_is = f"hypothesis field {scoring.hypothesis!r}", f"reference field {scoring.reference!r}"
            if scoring.text_metrics:
                ref_n, hyp_n = scoring.normalize(_text(key, ref, ref_is)), scoring.normalize(_text(key, hyp, hyp_is))
                result["scores"] = {}
                for metric in scoring.text_metrics:
                    counts, alignment = utterance_counts(ref_n, hyp_n, "word" if metric == "wer" else "char")
                    result["scores"][metric] = counts
                    if "alignment" not in result:  # words if wer is scored, else characters
                        result["alignment"] = {"ops": "".join(op for op, _, _ in alignment),
                                               "ref": [r for _, r, _ in alignment], "hyp": [h for _, _, h in alignment]}
            if scoring.pairs:  # checked here, so a bad value fails its shard naming the key
                result["prediction"], result["target"] = str(hyp).strip(), str(ref).strip()
                if "classification" in scoring.metrics:
                    result["prediction"], result["target"] = _label(key, hyp, hyp_is), _label(key, ref, ref_is)
                if "regression" in scoring.metrics:
                    _number(key, hyp, hyp_is)
                    _number(key, ref, ref_is)
                if scoring.scores:
                    _number(key, hyp, hyp_is)
                    binary_label(key, ref)
            if scoring.group_by:
                result["group"] = str(_value(dataset, key, scoring.group_by, "group_by"))
            results.append(result)
        return results if isinstance(keys, list) else results[0]

    @staticmethod
    def init_state(*, scoring, **env):
        return {"overall": scoring.new_metrics(), "groups": {}}

    @staticmethod
    def reduce_state(state, result, *, scoring, **env):
        targets = [state["overall"]]
        if scoring.group_by:
            targets.append(state["groups"].setdefault(result["group"], scoring.new_metrics()))
        for metrics in targets:
            for name, metric in metrics.items():
                if name in TEXT_METRICS:
                    metric.add(result["scores"][name])
                elif name == "classification":
                    metric.update([result["target"]], [result["prediction"]])
                else:  # regression
                    metric.update([float(result["target"])], [float(result["prediction"])])
        return state

    @staticmethod
    def finalize_state(state, shard_dir, *, scoring, **env) -> list[str]:
        from snakeshard.io.atomic import atomic_write_text

        record = {"scoring": scoring.describe(),
                  "metrics": {name: m.state() for name, m in state["overall"].items()},
                  "groups": {g: {name: m.state() for name, m in metrics.items()}
                             for g, metrics in sorted(state["groups"].items())}}
        atomic_write_text(Path(shard_dir) / STATE_FILE, json.dumps(record, sort_keys=True) + "\n")
        return [STATE_FILE]

    @classmethod
    def merge(cls, shard_dirs: list[Path], output_dir: Path) -> list[str]:
        """Per-key fields: the default merge. Additive metrics: the shards' states merged; score metrics:
        computed from the merged ``prediction``/``target`` fields (plan order), once."""
        from snakeshard.core.merge import merge_fragments
        from snakeshard.io.atomic import atomic_write_text

        names = merge_fragments(shard_dirs, output_dir)
        states = [json.loads((d / STATE_FILE).read_text(encoding="utf-8")) for d in shard_dirs]
        scoring = states[0]["scoring"]
        for shard_dir, state in zip(shard_dirs[1:], states[1:]):
            if state["scoring"] != scoring:
                raise MergeError(f"{shard_dir}/{STATE_FILE} was scored as {state['scoring']}, {shard_dirs[0]} as "
                                 f"{scoring}: rerun the stage")
        metrics = {name: _merged(name, [s["metrics"][name] for s in states]) for name in states[0]["metrics"]}
        groups = {}
        for group in sorted({g for s in states for g in s["groups"]}):
            parts = [s["groups"][group] for s in states if group in s["groups"]]
            groups[group] = {name: _merged(name, [p[name] for p in parts]) for name in parts[0]}
        if "dcf" in scoring:  # a score metric is asked for (Scoring.describe)
            metrics.update(_score_metrics(Path(output_dir), scoring))
        record = {"scoring": scoring,
                  "merge_kinds": {m: "additive" if m in ADDITIVE_METRICS else "all-data" for m in scoring["metrics"]},
                  "metrics": metrics, "groups": groups}
        atomic_write_text(Path(output_dir) / METRICS_JSON,
                          json.dumps(_strict(record), indent=1, sort_keys=True, allow_nan=False) + "\n")
        text = metrics_text(record)
        atomic_write_text(Path(output_dir) / METRICS_TXT, text)
        print(text, end="")
        return [*names, METRICS_JSON, METRICS_TXT]

    @classmethod
    def report(cls, set_dir: Path, name: str, path: Path) -> None:
        plot_metrics(json.loads((Path(set_dir) / METRICS_JSON).read_text(encoding="utf-8")), Path(set_dir), path)


def _strict(value):
    """``value`` with each non-finite float as None: a metric undefined on this data (R2 of a constant target, AUROC
    of one class) is null in metrics.json, which strict JSON parsers read (a bare NaN they refuse: a user trial)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def _merged(name: str, states: list[dict]) -> dict:
    """An additive metric's merged value and sufficient statistics."""
    metric = ADDITIVE[name].merge(states)
    return {"value": metric.compute(), "state": metric.state()}


def _score_metrics(set_dir: Path, scoring: dict) -> dict:
    """AUROC, AUPRC, EER, minDCF over every key's merged score and label."""
    from snakeshard.metrics import BinaryScores

    pairs = merged_pairs(set_dir)
    scores = BinaryScores(**scoring["dcf"])
    scores.update([k for k, _, _ in pairs], [float(p) for _, p, _ in pairs], [binary_label(k, t) for k, _, t in pairs])
    value = scores.compute()
    return {m: {"value": {m: value[m], "items": value["items"], "positives": value["positives"],
                          "negatives": value["negatives"], **({"dcf": scoring["dcf"]} if m == "min_dcf" else {})}}
            for m in scoring["metrics"] if m in SCORE_METRICS}
