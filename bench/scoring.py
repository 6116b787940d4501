"""Benchmark (not a test): the scoring stage (WER) end to end vs one jiwer call, and merging 1,000 metric states.

Data (``make_pairs``, deterministic: random.Random(0)): N utterances ``utt000000`` ... whose reference is 3-20
words drawn (Zipf-like) from a vocabulary of 2,000 made-up words, and whose hypothesis is the reference with
~15% of its words substituted, ~3% deleted and ~3% words inserted; each side then independently gets some upper
case (a capital first word, capitalized words) and punctuation (a final . ? or !, commas). Written as JSON Lines
``{"key": "utt000000", "ref": "...", "hyp": "..."}`` (no audio: the stage is sharded by count). Two parts,
chosen with ``--part``:

wer     N utterances (``--utts``). Snakeshard side: a copy of Snakefile, workflow/ and config/ whose config
        has only a ``score`` stage (ScoringRunner and ScoringProvider, ``provider_config: {metrics: [wer],
        hypothesis: hyp, reference: ref, normalize: [lowercase, remove_punctuation]}``) over that manifest
        (``{format: jsonl, key_field: key}``; not chained, so ``hyp`` is a field of the dataset), with NO
        ``sharding:`` key (the runner's default, shard_size 50,000), and, with ``--shard-size S``, a second
        copy with ``sharding: {shard_size: S}``. Timed: ``snakemake --profile config/profiles/local --cores 2``
        from a clean state (results/ and .snakemake/ deleted before each run): parse, plan, canary, shard
        jobs, merge, and the report job that draws metrics.png (part of the default target). Baseline: ONE
        separate Python process (``BASELINE``, timed the same way, so interpreter start-up and imports count
        on both sides) that reads the manifest, normalizes both sides with ``jiwer.Compose([jiwer.ToLowerCase(),
        jiwer.RemovePunctuation()])``, makes one ``jiwer.process_words(refs, hyps)`` call over every
        utterance and writes WER and counts to a JSON file, with its own timings of each step (the jiwer call
        alone among them). Runs are interleaved (the order rotates each round); the table gives medians of R
        runs (``--repeats``) and speedup = baseline / case (the issue's goal: snakeshard >= 1.5x). After its
        first run, each snakeshard case is checked: results/score/big/metrics.json's WER
        (``metrics["wer"]["value"]``) equal to the baseline's exactly, and S, D, I, hits too; and the run's
        logs give a timeline of where its time went: the canary job (its log's birth time, its done's
        mtime), each shard job's log file birth time (the job's process is up), the ``start`` (env built:
        the manifest read) and ``end`` of its ``split.N/done``, the merge (merge.log's birth time to
        merged.json's mtime) and the report job (metrics.png's mtime). At the end, ``snakemake -n`` of each
        case alone, from a clean state (start-up, parse, plan).
merge   in-process, no Snakemake: M = 1,000 (``--states``) shard states over a partition of ``--merge-utts``
        (default 100,000) utterances into M contiguous equal parts, each state holding a WordErrorRate (the
        per-utterance counts of the scratch run below, added per part: what each shard's
        ``WordErrorRate.update`` would have summed), a ConfusionMatrix (10 classes, 80% right) and a
        RegressionMetrics (Gaussian targets, noisy predictions) over synthetic data of the same size, written
        by ``ScoringRunner.finalize_state`` as ``split.N/metric_state.json``, as shard jobs write them. Timed
        (page cache warm: the files were just written): reading and json-parsing the M files, then per metric
        ``cls.merge(states).compute()``; vs computing each metric from scratch over all utterances
        (``WordErrorRate(normalize).update(refs, hyps)`` -- jiwer on every pair -- then ``compute()``; the
        other two ``update`` over all the synthetic data). Interleaved, medians of R runs. Checked: the merged
        WER and confusion matrix equal the scratch ones exactly (integers, and every computed value), the
        regression within 1e-12 relative.

Every ``snakemake`` process on this machine stalls ~10 s at start-up unless a SLURM controller answers, so the
script brings up the local single-node cluster for the wer part if none answers, and stops it afterwards
(collect_stats.local_slurm; a controller that already answers is used and left running).

    python bench/scoring.py [--part wer|merge|all] [--utts 100000] [--shard-size S] [--repeats 3]
                            [--states 1000] [--merge-utts 100000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import machine_info, rotated, timed_run
from collect_stats import local_slurm
from dryrun_scale import REPO, copy_workflow
from fbank_stage import SNAKEMAKE, run_snakeshard

WORK = REPO / "bench" / "work" / "scoring"
SET_DIR = Path("results") / "score" / "big"  # relative to a project dir
NORMALIZE = ["lowercase", "remove_punctuation"]
COUNTS = ("substitutions", "deletions", "insertions", "hits")

CONFIG = """\
output_dir: results
datasets:
  big: {{path: {data}, format: jsonl, key_field: key}}
stages:
  score:
    runner: snakeshard.stages.ScoringRunner
    provider: snakeshard.stages.ScoringProvider
    provider_config: {{metrics: [wer], hypothesis: hyp, reference: ref, normalize: [lowercase, remove_punctuation]}}
    datasets: [big]
{sharding}    resources: {{mem_mb: 1000, runtime: 30, cpus_per_task: 1}}
"""

# The baseline: one process, one jiwer call. argv: the manifest, the output JSON.
BASELINE = """\
import json, sys, time
t0 = time.perf_counter()
import jiwer
t1 = time.perf_counter()
refs, hyps = [], []
with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        record = json.loads(line)
        refs.append(record["ref"])
        hyps.append(record["hyp"])
t2 = time.perf_counter()
normalize = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation()])
refs, hyps = normalize(refs), normalize(hyps)
t3 = time.perf_counter()
out = jiwer.process_words(refs, hyps)
t4 = time.perf_counter()
result = {"wer": out.wer, "substitutions": out.substitutions, "deletions": out.deletions,
          "insertions": out.insertions, "hits": out.hits, "utterances": len(refs),
          "seconds": {"import_jiwer": t1 - t0, "read": t2 - t1, "normalize": t3 - t2, "process_words": t4 - t3}}
with open(sys.argv[2], "w") as f:
    f.write(json.dumps(result) + "\\n")
"""


# -- data --

def make_pairs(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """n (key, reference, hypothesis) triples: see the module docstring."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = set()
    while len(vocab) < 2000:
        vocab.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 10))))
    vocab = sorted(vocab)
    weights = [1 / (rank + 10) for rank in range(len(vocab))]  # Zipf-like: frequent words exist

    def words(k: int) -> list[str]:
        return rng.choices(vocab, weights, k=k)

    def dress(ws: list[str]) -> str:
        """Some upper case and punctuation, as transcripts and ASR output have them."""
        ws = [w.capitalize() if rng.random() < 0.05 else w for w in ws]
        ws = [w + "," if rng.random() < 0.05 else w for w in ws]
        if rng.random() < 0.5:
            ws[0] = ws[0].capitalize()
        if rng.random() < 0.1:
            ws[rng.randrange(len(ws))] = ws[rng.randrange(len(ws))].upper()
        return " ".join(ws) + rng.choice(("", ".", ".", "?", "!"))

    triples = []
    for i in range(n):
        ref = words(rng.randint(3, 20))
        hyp = []
        for w in ref:
            r = rng.random()
            if r < 0.15:
                hyp.append(words(1)[0])  # a substitution (rarely the same word: then a hit)
            elif r >= 0.18:  # 0.15..0.18: deleted
                hyp.append(w)
            if rng.random() < 0.03:
                hyp.extend(words(1))  # an insertion
        if not hyp:
            hyp = words(1)
        triples.append((f"utt{i:06d}", dress(ref), dress(hyp)))
    return triples


def write_manifest(path: Path, triples) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for key, ref, hyp in triples:
            f.write(json.dumps({"key": key, "ref": ref, "hyp": hyp}) + "\n")


# -- part wer --

def make_project(where: Path, manifest: Path, sharding: str = "") -> Path:
    """where (workflow copy + a config with only the score stage over manifest); returns it."""
    shutil.rmtree(where, ignore_errors=True)
    copy_workflow(where)
    (where / "config" / "config.yaml").write_text(CONFIG.format(data=manifest, sharding=sharding))
    return where


def run_baseline(manifest: Path, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of the baseline process, which writes its result and timings to ``out``."""
    out.unlink(missing_ok=True)
    return timed_run([sys.executable, "-c", BASELINE, str(manifest), str(out)], out.parent, "baseline")


def check_equal(root: Path, baseline: dict) -> str:
    """One line: the merged WER and counts vs the baseline's, exactly."""
    value = json.loads((root / SET_DIR / "metrics.json").read_text())["metrics"]["wer"]["value"]
    fields = ("wer", *COUNTS, "utterances")
    bad = [f"{f} {value[f]!r} vs {baseline[f]!r}" for f in fields if value[f] != baseline[f]]
    got = ", ".join(f"{f} {value[f]!r}" for f in fields)
    return f"FAILED: {'; '.join(bad)}" if bad else f"OK: identical to the baseline's ({got})"


def birth(path: Path) -> float:
    """The file's creation time (statx via coreutils ``stat %w``), in seconds since the epoch."""
    text = subprocess.run(["stat", "-c", "%w", str(path)], capture_output=True, text=True, check=True).stdout.strip()
    day, clock, zone = text.split()
    seconds, _, fraction = clock.partition(".")
    stamp = datetime.datetime.fromisoformat(f"{day} {seconds}{zone[:3]}:{zone[3:]}").timestamp()
    return stamp + float(f"0.{fraction or 0}")


def timeline(root: Path, launched: float, wall: float) -> list[tuple[str, float, str]]:
    """(event, seconds since snakemake was launched, what happened in between) from one run's files."""
    set_dir = root / SET_DIR
    events = []
    canary_log = root / "results" / "score" / "logs" / "canary.log"
    if canary_log.exists():
        events.append(("canary: job process up (log created)", birth(canary_log), "snakemake start-up, parse, plan"))
    for canary in (root / "results" / "score" / "_canary").glob("*/done"):
        events.append(("canary: done written", canary.stat().st_mtime, "canary job"))
    plan = json.loads((set_dir / "plan.json").read_text())
    for n in range(plan["num_shards"]):
        done = json.loads((set_dir / f"split.{n}" / "done").read_text())
        events += [(f"shard {n}: job process up (log created)", birth(set_dir / "logs" / f"split.{n}.log"),
                    "scheduling, interpreter start-up, snakeshard.cli import"),
                   (f"shard {n}: env built (done.start)", done["start"], "imports, provider: manifest read"),
                   (f"shard {n}: {done['items']:,} items scored, written (done.end)", done["end"],
                    "forward (normalize, jiwer per key), writers, state")]
    events += [("merge: job process up (merge.log created)", birth(set_dir / "logs" / "merge.log"),
                "snakemake notices the shards, starts the merge"),
               ("merge: merged.json written", (set_dir / "merged.json").stat().st_mtime,
                "merge: fragments (scores, alignment), states, metrics.json/txt"),
               ("report: metrics.png written", (set_dir / "metrics.png").stat().st_mtime,
                "report job (matplotlib)"),
               ("snakemake exited", launched + wall, "report job's exit, snakemake's wrap-up and exit")]
    return [(what, at - launched, note) for what, at, note in sorted(events, key=lambda e: e[1])]


def part_wer(utts: int, shard_size: int | None, repeats: int) -> None:
    where = WORK / "wer"
    shutil.rmtree(where, ignore_errors=True)
    manifest = where / "data" / "utts.jsonl"
    t0 = time.perf_counter()
    write_manifest(manifest, make_pairs(utts))
    print(f"  data: {utts:,} utterances, {manifest.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s",
          flush=True)
    projects = {"snakeshard": make_project(where / "default", manifest)}
    if shard_size:
        projects[f"snakeshard_{shard_size}"] = make_project(
            where / f"shard{shard_size}", manifest, sharding=f"    sharding: {{shard_size: {shard_size}}}\n")
    baseline_out = where / "baseline.json"
    runs = {"baseline": [], **{case: [] for case in projects}}
    internals, checks, timelines = [], {}, {}
    for rep in range(repeats):
        for case in rotated(runs, rep):
            if case == "baseline":
                r = run_baseline(manifest, baseline_out)
                internals.append(json.loads(baseline_out.read_text())["seconds"])
            else:
                launched = time.time()
                r = run_snakeshard(projects[case])
                if rep == 0:
                    timelines[case] = timeline(projects[case], launched, r[0])
            runs[case].append(r)
            print(f"  repeat {rep}: {case} {r[0]:.2f} s wall, {r[1]:.2f} s CPU", flush=True)
        if rep == 0:
            baseline = json.loads(baseline_out.read_text())
            checks = {case: check_equal(root, baseline) for case, root in projects.items()}
    dry = {}
    for case, root in projects.items():
        for name in ("results", ".snakemake"):
            shutil.rmtree(root / name, ignore_errors=True)
        dry[case] = timed_run([*SNAKEMAKE, "-n", "-q"], root, "snakemake -n")

    med = {case: (statistics.median(w for w, _ in rs), statistics.median(c for _, c in rs))
           for case, rs in runs.items()}
    inner = {step: statistics.median(s[step] for s in internals) for step in internals[0]}
    print(f"\n**wer**: {utts:,} utterances (JSON Lines manifest, 3-20 words each), WER with normalize [lowercase, "
          f"remove_punctuation]; median of {repeats} interleaved runs (each run's wall time in brackets); CPU: the "
          "process (baseline) or all of snakemake's child processes (snakeshard)\n")
    print("| case | wall s | CPU s | speedup (baseline / case, wall) |")
    print("|---|---:|---:|---:|")
    labels = {"baseline": "baseline: one process, one `jiwer.process_words` over all utterances",
              "snakeshard": "snakemake --profile config/profiles/local --cores 2, default sharding (shard_size 50000)"}
    if shard_size:
        labels[f"snakeshard_{shard_size}"] = f"the same, `sharding: {{shard_size: {shard_size}}}`"
    for case, rs in runs.items():
        each = ", ".join(f"{w:.2f}" for w, _ in rs)
        speed = "baseline" if case == "baseline" else f"**{med['baseline'][0] / med[case][0]:.2f}x**"
        print(f"| {labels[case]} | {med[case][0]:.2f} ({each}) | {med[case][1]:.2f} | {speed} |")
    print("\nInside the baseline process (medians, s): "
          + ", ".join(f"{step} {s:.2f}" for step, s in inner.items())
          + f"; the jiwer call alone (process_words): {inner['process_words']:.2f} s")
    for case, line in checks.items():
        print(f"- check ({case}): {line}")
    for case, (wall, _) in dry.items():
        print(f"- `snakemake -n` alone ({case}, clean state: start-up, parse, plan): {wall:.2f} s")
    for case, events in timelines.items():
        print(f"\nWhere the time goes: {case}, first run ({runs[case][0][0]:.2f} s), seconds since snakemake was "
              "launched\n")
        print("| event | at s | since previous event s | in between |")
        print("|---|---:|---:|---|")
        previous = 0.0
        for what, at, note in events:
            print(f"| {what} | {at:.2f} | {at - previous:.2f} | {note} |")
            previous = at
    print()


# -- part merge --

def synthetic_labels(n: int, rng: random.Random) -> tuple[list[str], list[str], list[float], list[float]]:
    """Classification (reference, prediction) over 10 classes, 80% right; regression (target, prediction)."""
    classes = [f"class{c}" for c in range(10)]
    refs = [rng.choice(classes) for _ in range(n)]
    preds = [r if rng.random() < 0.8 else rng.choice(classes) for r in refs]
    targets = [rng.gauss(50.0, 10.0) for _ in range(n)]
    predictions = [t + rng.gauss(0.0, 2.0) for t in targets]
    return refs, preds, targets, predictions


def write_states(root: Path, m: int, scored: list[dict], synthetic) -> list[Path]:
    """M shard dirs, each with the metric_state.json ScoringRunner.finalize_state writes for its part."""
    from snakeshard.metrics import ConfusionMatrix, RegressionMetrics, WordErrorRate
    from snakeshard.stages.scoring import Scoring, ScoringRunner

    scoring = Scoring({"metrics": ["wer", "classification", "regression"], "normalize": NORMALIZE})
    refs, preds, targets, predictions = synthetic
    n = len(scored)
    dirs = []
    for s in range(m):
        lo, hi = s * n // m, (s + 1) * n // m
        wer = WordErrorRate(scoring.normalize)
        for counts in scored[lo:hi]:
            wer.add(counts)
        confusion, regression = ConfusionMatrix(), RegressionMetrics()
        confusion.update(refs[lo:hi], preds[lo:hi])
        regression.update(targets[lo:hi], predictions[lo:hi])
        shard_dir = root / f"split.{s}"
        shard_dir.mkdir(parents=True)
        state = {"overall": {"wer": wer, "classification": confusion, "regression": regression}, "groups": {}}
        ScoringRunner.finalize_state(state, shard_dir, scoring=scoring)
        dirs.append(shard_dir)
    return dirs


def merge_states(dirs: list[Path]) -> tuple[dict, dict]:
    """({metric: computed value}, {step: seconds}): read and parse every state, then merge and compute each metric."""
    from snakeshard.metrics import ConfusionMatrix, RegressionMetrics, WordErrorRate
    from snakeshard.stages.scoring import STATE_FILE

    seconds = {}
    t0 = time.perf_counter()
    states = [json.loads((d / STATE_FILE).read_text(encoding="utf-8")) for d in dirs]
    seconds["read+parse"] = time.perf_counter() - t0
    values = {}
    for name, cls in (("wer", WordErrorRate), ("classification", ConfusionMatrix), ("regression", RegressionMetrics)):
        t0 = time.perf_counter()
        values[name] = cls.merge([s["metrics"][name] for s in states]).compute()
        seconds[name] = time.perf_counter() - t0
    return values, seconds


def from_scratch(triples, synthetic) -> tuple[dict, dict, list[dict]]:
    """({metric: computed value}, {metric: seconds}, per-utterance WER counts): every metric over all the data."""
    from snakeshard.metrics import ConfusionMatrix, RegressionMetrics, WordErrorRate

    refs, preds, targets, predictions = synthetic
    seconds, values = {}, {}
    t0 = time.perf_counter()
    wer = WordErrorRate(NORMALIZE)
    scored = wer.update([r for _, r, _ in triples], [h for _, _, h in triples])
    values["wer"] = wer.compute()
    seconds["wer"] = time.perf_counter() - t0
    for name, metric, args in (("classification", ConfusionMatrix(), (refs, preds)),
                               ("regression", RegressionMetrics(), (targets, predictions))):
        t0 = time.perf_counter()
        metric.update(*args)
        values[name] = metric.compute()
        seconds[name] = time.perf_counter() - t0
    return values, seconds, scored


def times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:,.0f}x"


def check_merge(merged: dict, scratch: dict) -> list[str]:
    """WER and confusion matrix: every computed value identical; regression: within 1e-12 relative."""
    lines = []
    for name in ("wer", "classification"):
        same = merged[name] == scratch[name]
        shown = f" ({', '.join(f'{k} {merged[name][k]!r}' for k in ('wer', *COUNTS))})" if name == "wer" else ""
        lines.append(f"{'OK' if same else 'FAILED'}: {name}: merged compute() "
                     f"{'identical to' if same else 'DIFFERS from'} the scratch one{shown}")
    rel = max(abs(merged["regression"][k] - scratch["regression"][k]) / abs(scratch["regression"][k])
              for k in ("mse", "rmse", "mae", "pearson", "r2"))
    ok = rel <= 1e-12 and merged["regression"]["items"] == scratch["regression"]["items"]
    lines.append(f"{'OK' if ok else 'FAILED'}: regression: max relative difference {rel:.1e} (tolerance 1e-12), "
                 f"items {merged['regression']['items']} vs {scratch['regression']['items']}")
    return lines


def part_merge(utts: int, m: int, repeats: int) -> None:
    where = WORK / "merge"
    shutil.rmtree(where, ignore_errors=True)
    triples = make_pairs(utts)
    synthetic = synthetic_labels(utts, random.Random(1))
    runs = {"scratch": [], "merge": []}
    dirs = None
    for rep in range(repeats):
        for case in rotated(runs, rep):
            if case == "scratch":
                scratch, seconds, scored = from_scratch(triples, synthetic)
                if dirs is None:  # the states: the first scratch run's per-utterance counts, added per part
                    t0 = time.perf_counter()
                    dirs = write_states(where, m, scored, synthetic)
                    print(f"  wrote {m:,} states in {time.perf_counter() - t0:.1f} s", flush=True)
            else:
                if dirs is None:
                    continue  # no states yet (the scratch case comes second in this round)
                merged, seconds = merge_states(dirs)
            runs[case].append(seconds)
            print(f"  repeat {rep}: {case} " + ", ".join(f"{k} {v:.4f} s" for k, v in seconds.items()), flush=True)
    checks = check_merge(merged, scratch)

    med = {case: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for case, rs in runs.items()}
    total = {case: sum(steps.values()) for case, steps in med.items()}
    print(f"\n**merge**: {m:,} shard states (metric_state.json as ScoringRunner.finalize_state writes them, "
          f"{utts // m:,} utterances each) of {utts:,} utterances: merge vs from scratch, in-process, medians of "
          f"{len(runs['merge'])} (merge) and {len(runs['scratch'])} (scratch) interleaved runs, page cache warm\n")
    print("| metric | from scratch s | merge of the states s | scratch / merge |")
    print("|---|---:|---:|---:|")
    print(f"| read + json-parse {m:,} state files | - | {med['merge']['read+parse']:.4f} | - |")
    for name, label in (("wer", "WER (`WordErrorRate.update` over every pair: jiwer per utterance)"),
                        ("classification", "ConfusionMatrix (10 classes)"), ("regression", "RegressionMetrics")):
        print(f"| {label} | {med['scratch'][name]:.4f} | {med['merge'][name]:.4f} | "
              f"{times(med['scratch'][name] / med['merge'][name])} |")
    print(f"| **all three** (merge: with reading the files) | {total['scratch']:.4f} | {total['merge']:.4f} | "
          f"**{times(total['scratch'] / total['merge'])}** |")
    wer_merge = med["merge"]["read+parse"] + med["merge"]["wer"]
    print(f"\nWER alone, merge with reading every file: {wer_merge:.4f} s vs {med['scratch']['wer']:.2f} s from "
          f"scratch: {times(med['scratch']['wer'] / wer_merge)}")
    for line in checks:
        print(f"- check: {line}")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("wer", "merge", "all"), default="all")
    ap.add_argument("--utts", type=int, default=100_000, help="wer: utterances")
    ap.add_argument("--shard-size", type=int, help="wer: also a case with sharding: {shard_size: S}")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each case")
    ap.add_argument("--states", type=int, default=1_000, help="merge: shard states")
    ap.add_argument("--merge-utts", type=int, default=100_000, help="merge: utterances over all states")
    args = ap.parse_args()

    from importlib.metadata import version

    import snakemake

    print(f"- {machine_info(snakemake=snakemake.__version__, jiwer=version('jiwer'))}")
    t0 = time.perf_counter()
    if args.part in ("wer", "all"):
        with local_slurm() as how:
            print(f"- SLURM controller: {how}", flush=True)
            part_wer(args.utts, args.shard_size, args.repeats)
    if args.part in ("merge", "all"):
        part_merge(args.merge_utts, args.states, args.repeats)
    print(f"- whole script: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
