"""The scoring stage through real snakemake runs: metrics equal whole-set references for any sharding.

One module-scoped run scores a JSON Lines set (60 records: text pairs, class labels, numbers, verification
trials) with ScoringRunner stages over 1, 3 and 7 shards and batch sizes 1 and 8; each merged
metrics.json is checked against a reference computed here over all records at once (jiwer for WER/CER,
direct formulas for the rest). Other tests: the demo's score stage and when it reruns, bad inputs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jiwer
import numpy as np
import pytest
from conftest import TOY_MODULE, copy_workflow, read_config, run_cli, run_snakemake, write_config

SCORING = {"runner": "snakeshard.stages.ScoringRunner", "provider": "snakeshard.stages.ScoringProvider",
           "datasets": ["scored"]}
NORMALIZE = ["lowercase", "remove_punctuation"]
FAMILIES = {
    "text": {"metrics": ["wer", "cer"], "hypothesis": "hyp", "reference": "ref", "normalize": NORMALIZE,
             "group_by": "spk"},
    "cls": {"metrics": ["classification"], "hypothesis": "pred", "reference": "label"},
    "reg": {"metrics": ["regression"], "hypothesis": "estimate", "reference": "value"},
    "trials": {"metrics": ["auroc", "auprc", "eer", "min_dcf"], "hypothesis": "score", "reference": "target"},
}
# text over every layout; the other families over two (their merges are unit-tested in test_metrics.py)
LAYOUTS = {"text": [(1, 1), (1, 8), (3, 1), (3, 8), (7, 1), (7, 8)], "cls": [(3, 8), (7, 1)],
           "reg": [(3, 8), (7, 1)], "trials": [(3, 8), (7, 1)]}
WORDS = "ten of clubs four queen hearts seven spades the amiable he might even have been made".split()


def make_records(n: int = 60) -> list[dict]:
    rng = random.Random(7)
    records = []
    for i in range(n):
        ref = [rng.choice(WORDS) for _ in range(rng.randint(2, 9))]
        hyp = []
        for word in ref:
            r = rng.random()
            if r < 0.15:
                hyp.append(rng.choice(WORDS))  # substitution (or a lucky hit)
            elif r < 0.2:
                continue  # deletion
            else:
                hyp.append(word.upper() if rng.random() < 0.2 else word)  # case differences normalize away
            if rng.random() < 0.05:
                hyp.append(rng.choice(WORDS) + ",")  # insertion with punctuation
        label = rng.choice(["cat", "dog", "bird"])
        pred = label if rng.random() < 0.7 else rng.choice(["cat", "dog", "bird", "fish"])  # fish: never a label
        value = rng.gauss(3.0, 1.0)
        target = int(rng.random() < 0.4)
        records.append({"key": f"u{i:03d}", "spk": f"s{i % 4}", "ref": " ".join(ref),
                        "hyp": " ".join(hyp) if i != 5 else "", "label": label, "pred": pred,
                        "value": value, "estimate": value + rng.gauss(0, 0.3),
                        "target": target, "score": round(rng.gauss(1.0 if target else 0.0, 1.0), 1)})
    return records


def stage_name(family: str, shards: int, batch: int) -> str:
    return f"{family}_s{shards}_b{batch}"


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> tuple[Path, list[dict]]:
    wd = copy_workflow(tmp_path_factory.mktemp("scoring") / "wf")
    records = make_records()
    (wd / "data/scored.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = read_config(wd)
    config["datasets"] = {"scored": {"path": "data/scored.jsonl", "format": "jsonl"}}
    config["stages"] = {stage_name(f, s, b): {**SCORING, "provider_config": FAMILIES[f], "sharding": {"num_shards": s},
                                              "batch_size": b}
                        for f, layouts in LAYOUTS.items() for s, b in layouts}
    write_config(wd, config)
    # merged outputs only: drawing 12 PNGs would add ~1 s each (the demo test checks the report)
    targets = [f"results/{stage}/scored/merged.json" for stage in config["stages"]]
    run = run_snakemake(wd, *targets)
    assert run.returncode == 0, run.stderr[-3000:]
    return wd, records


def metrics_of(wd: Path, stage: str) -> dict:
    return json.loads((wd / "results" / stage / "scored" / "metrics.json").read_text())


def normalize(text: str) -> str:
    return jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation()])(text)


@pytest.mark.parametrize("shards, batch", LAYOUTS["text"])
def test_wer_and_cer_equal_jiwer_over_all_utterances(scored, shards, batch):
    wd, records = scored
    refs, hyps = [normalize(r["ref"]) for r in records], [normalize(r["hyp"]) for r in records]
    metrics = metrics_of(wd, stage_name("text", shards, batch))["metrics"]
    words = jiwer.process_words(refs, hyps)
    wer = metrics["wer"]["value"]
    assert wer["wer"] == pytest.approx(words.wer, rel=1e-12, abs=0)
    assert (wer["substitutions"], wer["deletions"], wer["insertions"], wer["hits"]) == (
        words.substitutions, words.deletions, words.insertions, words.hits)
    assert metrics["cer"]["value"]["cer"] == pytest.approx(jiwer.cer(refs, hyps), rel=1e-12, abs=0)
    assert wer["utterances"] == 60


def test_text_layouts_agree_byte_for_byte(scored):
    """Every layout merges to the same metrics.json, metrics.txt, scores and alignments."""
    wd, _ = scored
    names = ("metrics.json", "metrics.txt", "scores.jsonl", "alignment.jsonl", "group")
    first = {n: (wd / "results" / stage_name("text", 1, 1) / "scored" / n).read_bytes() for n in names}
    for shards, batch in LAYOUTS["text"][1:]:
        for n in names:
            assert (wd / "results" / stage_name("text", shards, batch) / "scored" / n).read_bytes() == first[n], n


def test_per_speaker_wer_equals_jiwer_per_speaker(scored):
    wd, records = scored
    record = metrics_of(wd, stage_name("text", 3, 8))
    assert sorted(record["groups"]) == ["s0", "s1", "s2", "s3"]
    for spk, group in record["groups"].items():
        mine = [r for r in records if r["spk"] == spk]
        want = jiwer.wer([normalize(r["ref"]) for r in mine], [normalize(r["hyp"]) for r in mine])
        assert group["wer"]["value"]["wer"] == pytest.approx(want, rel=1e-12, abs=0)
    text = (wd / "results" / stage_name("text", 3, 8) / "scored" / "metrics.txt").read_text()
    assert "WER per spk:" in text and "normalization (jiwer, both sides): lowercase, remove_punctuation" in text
    # the alignment of the key with an empty hypothesis: every reference word deleted
    alignments = [json.loads(line) for line in
                  (wd / "results" / stage_name("text", 3, 8) / "scored" / "alignment.jsonl").read_text().splitlines()]
    empty = next(a["value"] for a in alignments if a["key"] == "u005")
    assert set(empty["ops"]) == {"D"} and empty["hyp"] == [None] * len(empty["ref"])


@pytest.mark.parametrize("shards, batch", LAYOUTS["cls"])
def test_classification_equals_direct_formulas(scored, shards, batch):
    wd, records = scored
    value = metrics_of(wd, stage_name("cls", shards, batch))["metrics"]["classification"]["value"]
    labels, preds = [r["label"] for r in records], [r["pred"] for r in records]
    classes = sorted(set(labels) | set(preds))
    assert value["accuracy"] == pytest.approx(sum(a == b for a, b in zip(labels, preds)) / len(labels), rel=1e-12)
    f1s, recalls = [], []
    for c in classes:
        tp = sum(a == c and b == c for a, b in zip(labels, preds))
        precision = tp / preds.count(c) if preds.count(c) else 0.0
        recall = tp / labels.count(c) if labels.count(c) else 0.0
        f1s.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
        if labels.count(c):
            recalls.append(recall)
    assert value["f1_macro"] == pytest.approx(sum(f1s) / len(f1s), rel=1e-12)
    assert value["balanced_accuracy"] == pytest.approx(sum(recalls) / len(recalls), rel=1e-12)
    assert value["per_class"]["fish"]["support"] == 0 and value["per_class"]["fish"]["recall"] == 0.0


@pytest.mark.parametrize("shards, batch", LAYOUTS["reg"])
def test_regression_equals_numpy_over_all_items(scored, shards, batch):
    wd, records = scored
    value = metrics_of(wd, stage_name("reg", shards, batch))["metrics"]["regression"]["value"]
    y = np.array([r["value"] for r in records])
    p = np.array([r["estimate"] for r in records])
    assert value["mse"] == pytest.approx(np.mean((p - y) ** 2), rel=1e-12)
    assert value["mae"] == pytest.approx(np.mean(np.abs(p - y)), rel=1e-12)
    assert value["pearson"] == pytest.approx(np.corrcoef(y, p)[0, 1], rel=1e-12)
    assert value["r2"] == pytest.approx(1 - np.sum((p - y) ** 2) / np.sum((y - y.mean()) ** 2), rel=1e-12)


@pytest.mark.parametrize("shards, batch", LAYOUTS["trials"])
def test_verification_metrics_are_computed_once_over_all_trials(scored, shards, batch):
    """AUROC over every (target, non-target) pair, ties counting half; never a mean of per-shard values."""
    wd, records = scored
    record = metrics_of(wd, stage_name("trials", shards, batch))
    assert record["merge_kinds"] == {m: "all-data" for m in ("auroc", "auprc", "eer", "min_dcf")}
    pos = [float(r["score"]) for r in records if r["target"]]
    neg = [float(r["score"]) for r in records if not r["target"]]
    pairs = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    assert record["metrics"]["auroc"]["value"]["auroc"] == pytest.approx(pairs / (len(pos) * len(neg)), rel=1e-12)
    from snakeshard.metrics import BinaryScores

    whole = BinaryScores()
    whole.update([r["key"] for r in records], [r["score"] for r in records], [r["target"] for r in records])
    for name in ("auprc", "eer", "min_dcf"):
        assert record["metrics"][name]["value"][name] == whole.compute()[name]
    first = metrics_of(wd, stage_name("trials", *LAYOUTS["trials"][0]))
    assert record["metrics"] == first["metrics"]


# -- the demo's score stage: output files, report, and what reruns it --

def demo_asr_and_score(wd: Path) -> None:
    config = read_config(wd)
    config["stages"] = {s: config["stages"][s] for s in ("asr", "score")}
    config["datasets"] = {d: config["datasets"][d] for d in ("demo", "demo_asr")}
    write_config(wd, config)


def scored_jobs(run) -> list[str]:
    import re

    return sorted(set(re.findall(r"rule (\w+):", run.stdout + run.stderr)) - {"all"})


def test_demo_score_stage_reruns_when_the_hypotheses_change_and_only_then(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    demo_asr_and_score(wd)
    first = run_snakemake(wd)
    assert first.returncode == 0, first.stderr[-3000:]
    set_dir = wd / "results/score/demo_asr"
    text = (set_dir / "metrics.txt").read_text()
    assert text.startswith("WER 22.83% (15 sub, 3 del, 3 ins of 92 words, 10 utterances)\n")
    assert (set_dir / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    report = run_snakemake(wd, "--report", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr[-2000:]
    assert "metrics.png" in (tmp_path / "report.html").read_text(errors="replace")

    # nothing changed: nothing to do
    assert scored_jobs(run_snakemake(wd, "-n")) == []
    # another stage's config (asr's resources are not part of any fingerprint): still nothing
    config = read_config(wd)
    config["stages"]["asr"]["resources"]["mem_mb"] = 1200
    write_config(wd, config)
    assert scored_jobs(run_snakemake(wd, "-n")) == []
    # a transcript edited: only the score shard holding that key (asr ignores text), then merge and report
    ref = wd / "data/demo/text"
    ref.write_text(ref.read_text().replace("cards-001 ten of clubs", "cards-001 ten of hearts"))
    dry = run_snakemake(wd, "-n")
    assert scored_jobs(dry) == ["merge", "report", "shard_score"] and dry.stdout.count("rule shard_score:") == 1
    # the hypotheses change (asr's decoder config): asr reruns, and so does every score shard
    config["stages"]["asr"]["provider_config"] = {"decoder_options": {"beam": 1e-20}}
    write_config(wd, config)
    dry = run_snakemake(wd, "-n")
    assert dry.stdout.count("rule shard_asr:") == 2 and dry.stdout.count("rule shard_score:") == 2
    rerun = run_snakemake(wd)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert scored_jobs(run_snakemake(wd, "-n")) == []
    # a reference field the data lacks: named with the file of the records behind the asr output it scores (a user
    # trial: "the dataset (the source dataset)")
    config["stages"]["score"]["provider_config"]["reference"] = "txt"
    write_config(wd, config)
    bad = run_snakemake(wd)
    assert bad.returncode != 0
    assert "no reference: the dataset (data/demo) has no field 'txt' for it" in bad.stdout + bad.stderr


def jsonl_project(tmp_path: Path, records: list[dict], **provider_config) -> Path:
    wd = copy_workflow(tmp_path / "wf")
    (wd / "data/scored.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = read_config(wd)
    config["datasets"] = {"scored": {"path": "data/scored.jsonl", "format": "jsonl"}}
    config["stages"] = {"score": {**SCORING, "sharding": {"shard_size": 2},
                                  "provider_config": {**FAMILIES["text"], **provider_config}}}
    write_config(wd, config)
    return wd


def test_a_key_without_a_reference_fails_naming_it_and_nothing_merges(tmp_path):
    records = [{"key": f"k{i}", "spk": "a", "ref": "a b", "hyp": "a c"} for i in range(6)]
    del records[3]["ref"]
    wd = jsonl_project(tmp_path, records)
    run = run_snakemake(wd)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "item 'k3': no reference: the dataset (data/scored.jsonl) has no field 'ref' for it" in out
    assert "provider_config.reference" in out
    set_dir = wd / "results/score/scored"
    assert not (set_dir / "merged.json").exists() and not (set_dir / "metrics.json").exists()
    assert (set_dir / "split.0/done").exists() and (set_dir / "split.2/done").exists()  # the others kept theirs


def test_a_chained_stages_canary_runs_over_the_dataset_its_chain_reads(tmp_path):
    """User trial 10: the canary of a stage over the upstream's output for its second dataset (test) ran over the
    upstream canary's keys, those of its first dataset (train), and a scoring stage whose reference only test's
    records hold was refused (`item 'george-0-10': no reference ... train.jsonl`). Now the upstream stage gets a
    canary over test too (its own rule, not waited for by its shards), and the scoring canary checks test's keys."""
    wd = copy_workflow(tmp_path / "wf")
    (wd / "toy.py").write_text(TOY_MODULE)
    wav = "data/demo/wav/cards-001.wav"
    (wd / "data/train.jsonl").write_text("".join(json.dumps({"key": f"tr{i}", "audio": wav}) + "\n" for i in range(6)))
    (wd / "data/test.jsonl").write_text("".join(json.dumps({"key": f"te{i}", "audio": wav, "truth": f"TE{i}"}) + "\n"
                                                for i in range(6)))
    config = read_config(wd)
    config["datasets"] = {"train": {"path": "data/train.jsonl", "format": "jsonl"},
                          "test": {"path": "data/test.jsonl", "format": "jsonl"},
                          "upper_test": {"from_stage": "upper", "dataset": "test"}}
    config["stages"] = {
        "upper": {"runner": "toy.UpperRunner", "provider": "toy.ToyProvider", "provider_config": {},
                  "datasets": ["train", "test"], "sharding": {"num_shards": 2}},
        "score": {**SCORING, "datasets": ["upper_test"],
                  "provider_config": {"metrics": ["classification"], "hypothesis": "text", "reference": "truth"}},
    }
    write_config(wd, config)
    run = run_snakemake(wd)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "rule canary_upper_over_test:" in out and "rule canary_upper:" in out
    canaries = {str(p.parent.parent.relative_to(wd)): p.read_text().split()
                for p in wd.glob("results/*/_canary*/*/keys")}
    assert canaries == {"results/upper/_canary": ["tr0", "tr1"], "results/upper/_canary.test": ["te0", "te1"],
                        "results/score/_canary": ["te0", "te1"]}, canaries
    metrics = json.loads((wd / "results/score/upper_test/metrics.json").read_text())["metrics"]
    assert metrics["classification"]["value"]["accuracy"] == 1.0 and metrics["classification"]["value"]["items"] == 6
    again = run_snakemake(wd, "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout[-2000:]


def test_an_empty_reference_is_scored_as_jiwer_does_and_said(tmp_path):
    records = [{"key": "k0", "spk": "a", "ref": "", "hyp": "x y"}, {"key": "k1", "spk": "a", "ref": "a b", "hyp": "a b"},
               {"key": "k2", "spk": "b", "ref": "c d e", "hyp": "c"}]
    wd = jsonl_project(tmp_path, records)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    set_dir = wd / "results/score/scored"
    value = json.loads((set_dir / "metrics.json").read_text())["metrics"]["wer"]["value"]
    assert value["wer"] == jiwer.wer(["", "a b", "c d e"], ["x y", "a b", "c"])  # (2 ins + 2 del) / 5
    assert value["insertions"] == 2 and value["empty_references"] == 1
    assert "1 utterance(s) with an empty reference: scored as jiwer does" in (set_dir / "metrics.txt").read_text()


@pytest.mark.parametrize("provider_config, message", [
    ({"normalize": None}, "stages.score.provider_config.normalize: a list of text transforms"),
    ({"metrics": ["bleu"]}, "stages.score.provider_config.metrics: unknown metric 'bleu'; known: wer, cer,"),
    ({"metrics": ["wr"]}, "stages.score.provider_config.metrics: unknown metric 'wr' (did you mean 'wer'?); known:"),
    ({"metrics": "wer"}, "stages.score.provider_config.metrics: a list of metrics to compute (wer, cer,"),
    ({"normalize": ["lowercase", "stem"]}, "stages.score.provider_config.normalize: unknown text transform 'stem'"),
    ({"metrics": ["eer"], "p_target": "1%"},
     "stages.score.provider_config.p_target: a number (default 0.01), got '1%'"),
    ({"weights": 2},
     "stages.score.provider_config: 'weights' is not a key that snakeshard.stages.ScoringProvider takes (metrics, "),
])
def test_config_errors_name_the_key(tmp_path, provider_config, message):
    """A bad provider_config of the scoring stage, a misspelt metric as much as an unknown key, ends the parse
    naming the key: no job starts, not even the canary (before, bad values were found by the canary's job)."""
    wd = jsonl_project(tmp_path, [{"key": f"k{i}", "spk": "a", "ref": "a", "hyp": "a"} for i in range(4)],
                       **provider_config)
    run = run_snakemake(wd, "--config", "canary=2")
    assert run.returncode != 0 and f"snakeshard: error: {message}" in run.stdout + run.stderr, run.stderr[-2000:]
    assert "rule canary_score" not in run.stdout + run.stderr
    assert not (wd / "results/score/_canary").exists() and not list((wd / "results/score/scored").glob("split.*"))


def scoring_project(tmp_path: Path, records: list[dict], provider_config: dict) -> Path:
    """jsonl_project with the stage's provider_config exactly ``provider_config`` (hypothesis hyp, reference ref)."""
    wd = jsonl_project(tmp_path, records)
    config = read_config(wd)
    config["stages"]["score"]["provider_config"] = {"hypothesis": "hyp", "reference": "ref", **provider_config}
    write_config(wd, config)
    return wd


@pytest.mark.parametrize("provider_config, message", [
    ({"metrics": ["eer"], "p_target": 1.5},  # printed minDCF 1.0000, exit 0 (a user trial)
     "stages.score.provider_config.p_target: the prior of a target, between 0 and 1 (exclusive), got 1.5"),
    ({"metrics": ["min_dcf"], "c_miss": -1}, "stages.score.provider_config.c_miss: a cost, above 0, got -1"),
    ({"metrics": ["classification"], "normalize": ["lowercase"]},  # "b" and "B" stayed two classes, silently
     "stages.score.provider_config.normalize: a normalization of wer and cer text, and metrics ['classification'] "
     "holds neither: class labels are compared as written"),
    ({"metrics": ["auroc", "eer"], "group_by": "spk"},  # empty groups in metrics.json, silently
     "stages.score.provider_config.group_by: per-group values are computed for wer, cer, classification, "
     "regression; auroc, eer are computed over the whole set only"),
])
def test_options_a_metric_would_ignore_or_misread_end_the_parse_naming_the_key(tmp_path, provider_config, message):
    wd = scoring_project(tmp_path, [{"key": f"k{i}", "spk": "a", "ref": 1, "hyp": 0.5} for i in range(4)],
                         provider_config)
    run = run_snakemake(wd, "-n")
    assert run.returncode != 0 and f"snakeshard: error: {message}" in run.stdout + run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("metric, bad, message", [
    ("wer", ["a", "b"], "item 'k1': hypothesis field 'hyp' holds ['a', 'b'] (a list), not text: wer and cer score "
                        "strings (a token list: join it with spaces first)"),  # scored as "['a', 'b']" (a trial)
    ("classification", 1.5, "item 'k1': hypothesis field 'hyp' holds 1.5, not a class label: a string, or a whole "
                            "number"),
    ("regression", True, "item 'k1': hypothesis field 'hyp' holds True, not a finite number"),
    ("auroc", "nan", "item 'k1': hypothesis field 'hyp' holds 'nan', not a finite number"),  # failed only at merge
])
def test_a_json_value_a_metric_cannot_read_fails_its_shard_naming_key_and_field(tmp_path, metric, bad, message):
    """A JSON Lines field may hold any JSON value: each is checked for what its metric reads, in the shard, and
    the error names the key and the field (before, str() of it was scored: a token list as text, 1 and 1.0 as two
    classes, true as a number; a NaN score failed the merge with a traceback)."""
    good = {"wer": "a b", "classification": 1, "regression": 2.5, "auroc": 0.5}[metric]
    records = [{"key": f"k{i}", "ref": good if metric != "auroc" else i % 2, "hyp": bad if i == 1 else good}
               for i in range(4)]
    wd = scoring_project(tmp_path, records, {"metrics": [metric], **({"normalize": []} if metric == "wer" else {})})
    run = run_snakemake(wd, "--config", "canary=0")
    assert run.returncode != 0
    assert message in (wd / "results/score/scored/logs/split.0.log").read_text()
    assert (wd / "results/score/scored/split.1/done").exists()  # k2, k3: the other shard kept its result


def test_whole_numbers_are_one_class_and_an_undefined_metric_is_null(tmp_path):
    """Labels 1, 1.0 and "1" are one class (as for scikit-learn); R2 and Pearson of a constant target are
    undefined: null in metrics.json (strict JSON; a bare NaN was written), 'undefined' in metrics.txt."""
    records = [{"key": "k0", "ref": 1, "hyp": 1.0}, {"key": "k1", "ref": "1", "hyp": 1}, {"key": "k2", "ref": 2,
                                                                                          "hyp": 2.0}]
    wd = scoring_project(tmp_path / "cls", records, {"metrics": ["classification"]})
    assert run_snakemake(wd).returncode == 0
    value = json.loads((wd / "results/score/scored/metrics.json").read_text())["metrics"]["classification"]["value"]
    assert value["accuracy"] == 1.0 and sorted(value["per_class"]) == ["1", "2"]
    records = [{"key": f"k{i}", "ref": 3.0, "hyp": 3.0 + i / 10} for i in range(4)]
    wd = scoring_project(tmp_path / "reg", records, {"metrics": ["regression"]})
    assert run_snakemake(wd).returncode == 0
    text = (wd / "results/score/scored/metrics.json").read_text()
    value = json.loads(text)["metrics"]["regression"]["value"]
    assert value["r2"] is None and value["pearson"] is None and "NaN" not in text
    assert "Pearson undefined, R2 undefined (4 items)" in (wd / "results/score/scored/metrics.txt").read_text()


def test_regression_per_group_is_printed_and_small_values_keep_their_digits(tmp_path):
    """metrics.txt prints regression per group (it was in metrics.json only), and an MSE of 1e-8 in 4 significant
    digits (it printed 0.0000); a JSON null value is named as null, not as a missing field (user trial 12)."""
    records = [{"key": f"k{i}", "spk": f"s{i % 2}", "ref": float(i), "hyp": i + 1e-4} for i in range(6)]
    wd = scoring_project(tmp_path / "reg", records, {"metrics": ["regression"], "group_by": "spk"})
    assert run_snakemake(wd).returncode == 0
    text = (wd / "results/score/scored/metrics.txt").read_text()
    assert text.startswith("MSE 1.000e-08, RMSE 1.000e-04, MAE 1.000e-04, Pearson 1.0000, R2 1.0000 (6 items)"), text
    assert "regression per spk:" in text and "\ns1            3  1.000e-08  1.000e-04     1.0000\n" in text, text
    records[2]["hyp"] = None
    wd = scoring_project(tmp_path / "null", records, {"metrics": ["regression"]})
    assert run_snakemake(wd, "--config", "canary=0").returncode != 0
    assert "item 'k2': its hypothesis field 'hyp' is null (stages.score.provider_config.hypothesis)" in (
        wd / "results/score/scored/logs/split.1.log").read_text()


def test_normalization_must_be_explicit_for_wer():
    from snakeshard.errors import ConfigError
    from snakeshard.stages.scoring import Scoring

    with pytest.raises(ConfigError, match=r"normalize: wer and cer need an explicit text normalization"):
        Scoring({"metrics": ["wer"]})
    assert Scoring({"metrics": ["wer"], "normalize": []}).describe()["normalize"] == []
    assert Scoring({"metrics": ["auroc"]}).describe()["dcf"] == {"p_target": 0.01, "c_miss": 1.0, "c_fa": 1.0}


def test_snakeshard_wer_names_a_key_on_one_side_only(tmp_path):
    (tmp_path / "ref").write_text("a x y\nb z\n")
    (tmp_path / "hyp").write_text("a x y\n")
    run = run_cli(tmp_path, "wer", "--hyp", "hyp", "--ref", "ref")
    assert run.returncode == 1 and "hyp: no line for key 'b'" in run.stderr
    (tmp_path / "hyp").write_text("a X Y\nb z\n")
    run = run_cli(tmp_path, "wer", "--hyp", "hyp", "--ref", "ref", "--normalize", "lowercase")
    assert run.returncode == 0 and run.stdout.startswith("WER 0.00% (0 sub, 0 del, 0 ins of 3 words, 2 utterances)")
    # read as a dataset's Kaldi text is (a user trial: a tab-separated line was a key 'a\tx y' missing from hyp)
    (tmp_path / "ref").write_text("a\tx y\nb z\n")
    run = run_cli(tmp_path, "wer", "--hyp", "hyp", "--ref", "ref", "--normalize", "lowercase")
    assert run.returncode == 0 and run.stdout.startswith("WER 0.00% (0 sub, 0 del, 0 ins of 3 words, 2 utterances)")
    for text, error in (("\ufeffa x y\nb z\n", "ref:1: starts with a UTF-8 byte-order mark (U+FEFF)"),
                        ("a x y\n\nb z\n", "ref:2: empty line (Kaldi tables have one 'key value' per line)")):
        (tmp_path / "ref").write_text(text)
        run = run_cli(tmp_path, "wer", "--hyp", "hyp", "--ref", "ref")
        assert run.returncode == 1 and error in run.stderr, run.stderr


def test_snakeshard_wer_with_cer_equals_jiwer_and_states_the_normalization(tmp_path):
    """`--cer` adds the character error rate on a second line; each line says how the text was normalized (a
    user trial set this command's figure beside jiwer's and could not tell which normalization each used)."""
    refs = {"a": "Ten of clubs", "b": "the amiable himself", "c": "queen"}
    hyps = {"a": "ten of club", "b": "he amiable", "c": "Queen hearts"}
    (tmp_path / "ref").write_text("".join(f"{k} {t}\n" for k, t in refs.items()))
    (tmp_path / "hyp").write_text("".join(f"{k} {t}\n" for k, t in hyps.items()))
    run = run_cli(tmp_path, "wer", "--hyp", "hyp", "--ref", "ref", "--cer", "--normalize", "lowercase", "--out", "w")
    assert run.returncode == 0, run.stderr
    wer_line, cer_line = run.stdout.splitlines()
    lower = [t.lower() for t in refs.values()], [t.lower() for t in hyps.values()]
    words, chars = jiwer.process_words(*lower), jiwer.process_characters(*lower)
    assert wer_line == (f"WER {100 * words.wer:.2f}% ({words.substitutions} sub, {words.deletions} del, "
                        f"{words.insertions} ins of 7 words, 3 utterances) normalize=lowercase hyp=hyp ref=ref")
    assert cer_line.startswith(f"CER {100 * chars.cer:.2f}% ({chars.substitutions} sub, {chars.deletions} del, "
                               f"{chars.insertions} ins of ")
    assert cer_line.endswith(" normalize=lowercase hyp=hyp ref=ref")
    assert (tmp_path / "w").read_text() == run.stdout
    plain = run_cli(tmp_path, "wer", "--hyp", "hyp", "--ref", "ref")
    assert plain.returncode == 0 and plain.stdout.count("\n") == 1 and " normalize=none hyp=hyp" in plain.stdout


def test_the_report_rule_refuses_a_stale_merge(scored):
    """`snakeshard report` (the report rule's command) draws only from the merge of the current plan."""
    wd, _ = scored
    set_dir = "results/text_s3_b8/scored"
    run = run_cli(wd, "report", "--spec", f"{set_dir}/spec.json", "--set-dir", set_dir, "--inputs", "not-the-plan",
                  "--output", f"{set_dir}/stale.png")
    assert run.returncode == 1 and "the merged output is stale" in run.stderr
    assert not (wd / set_dir / "stale.png").exists()


def test_reports_must_be_png_names(tmp_path, monkeypatch):
    from snakeshard.core.user_source import runner_reports
    from snakeshard.errors import ConfigError

    (tmp_path / "plots.py").write_text("class R:\n    reports = ('metrics.png', 'table.txt')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"stages.s.runner: plots.R.reports lists 'table.txt': reports are PNG"):
        runner_reports("plots.R", "stages.s")
