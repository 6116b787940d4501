"""Benchmark (not a test): a CPU worker pool for PocketSphinx ASR, in a shard job and against easycore.

Data: ``make_data`` of bench/fbank_stage.py, a Kaldi data dir of N keys (``--utts``, default 120) cycling
through the 10 demo wavs (16 kHz, 3.4 s on average; absolute paths in wav.scp, utt2dur copied from
data/demo). Two parts, chosen with ``--part``:

shard     ONE shard job (``sharding: {num_shards: 1}``) of the demo's ``asr`` stage (PocketsphinxRunner,
          PocketsphinxProvider, sample_rate 16000, batch_size null, no cpus_per_task: it follows
          ``workers``) in three cases: ``none`` (no ``workers`` key: forward in the job's own process),
          ``workers: 1`` (the same through a 1-worker pool: what the pool itself costs) and
          ``workers: 2``. Each case has its own copy of Snakefile, workflow/ and config/ (only that stage)
          over the same data dir. Timed, from a clean state (results/ and .snakemake/ deleted before each
          run): the whole ``snakemake --profile config/profiles/local --cores 2`` (parse, plan, canary (off),
          the shard job, merge), and, from each run, the shard job's own times: its loop (``done``'s
          end - start, which the job log's line ``shard 0: N items in T s`` repeats; for a pool it includes
          the workers' start-up and decoder loading, which without a pool happen before ``start``) and the
          whole job as Snakemake saw it (.snakemake/metadata starttime..endtime of split.0/done: process
          start, env build, pool start, loop, pool close). Speedup = none / case. Each run's merged
          results/asr/big/text is compared with the first run's and with the easycore part's texts (the
          script names the keys that differ: see "decoder state" below).
easycore  the same work in-process (no snakemake), ``OrderedRunner`` with 2 CPU workers: easycore 0.4.2's
          (``easycore.common.parallel``, fork, mp.Queue, a consumer thread, cfg a ``CfgNode``) vs
          snakeshard's ``snakeshard.pool.OrderedRunner`` (spawn, a pipe pair per worker). Same hooks:
          producer_init makes a decoder (``make_decoder()``), producer_work reads the wav (soundfile,
          int16), calls ``decoder.reinit_feat()`` and ``decode``s it, the consumer collects (key, text) in a
          list that consumer_end returns.
          Each run is a fresh subprocess (``--case``), killed with its process group after
          ``--case-timeout`` s (easycore hangs when a worker dies: a hang is reported, not waited for).
          Timed in it: ``cold`` = constructing the runner + a first call over all N items (worker start and
          model loading included), ``warm`` = a second call over the same N items with the workers kept
          alive (loading excluded), then ``close()``. Items/s = N / time; ratio = snakeshard / easycore.
          Both calls of both runners must give the same (key, text) list, in wav.scp order.
          easycore is NOT a project dependency: if bench/work/easycore/ lacks it, the script runs
          ``pip install --no-deps --target bench/work/easycore easycore==0.4.2`` and puts that dir on
          sys.path in the easycore case only (its parallel module imports nothing else but PyYAML, which
          the venv has for snakemake).

Decoder state: a PocketSphinx 5.1.1 decoder's text for an utterance can depend on the utterance it decoded
before (its feature front end keeps state; e.g. librivox_austen-0870 after cards-001 or cards-004 gives
"but mr john ..." instead of a fresh decoder's "and mr john ..."), although ``decode`` uses ``full_utt=True``.
With a pool, which worker decodes what depends on timing, so texts can change from run to run. The easycore
part calls ``decoder.reinit_feat()`` (~0.2 ms) before each utterance, which made 60 random reuses match a
fresh decoder, so its texts are comparable across runners and runs (``--no-reset`` leaves it out). The shard
part runs the demo stage unchanged (no reset): differing keys there are reported, not fatal.

Cases of both parts are interleaved in one rotation per repeat (``--repeats``, ``benchlib.rotated``); tables
give medians with every run in brackets. Every ``snakemake`` process on this machine stalls ~10 s at start-up
unless a SLURM controller answers, so the shard part runs inside ``collect_stats.local_slurm()`` (starts the
local cluster if none answers, and stops it afterwards; one already up is used and left alone).

    python bench/pool.py [--part shard|easycore|all] [--utts 120] [--repeats 3] [--case-timeout S]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import cpu_children, machine_info, rotated
from dryrun_scale import REPO, copy_workflow
from fbank_stage import make_data, run_snakeshard

from snakeshard.pool import OrderedRunner as SnakeshardOrderedRunner

WORK = REPO / "bench" / "work" / "pool"
EASYCORE_DIR = REPO / "bench" / "work" / "easycore"
EASYCORE_VERSION = "0.4.2"
WORKERS = 2
MERGED = Path("results") / "asr" / "big"  # relative to a project dir

CONFIG = """\
output_dir: results
datasets:
  big: {{path: {data}, format: kaldi}}
stages:
  asr:
    runner: snakeshard.demo.asr.PocketsphinxRunner
    provider: snakeshard.demo.asr.PocketsphinxProvider
    provider_config: {{}}
    datasets: [big]
    batch_size: null
    sample_rate: 16000
    sharding: {{num_shards: 1}}
{workers}    resources: {{mem_mb: 1000, runtime: 30}}
"""
SHARD_CASES = {"none": "", "workers1": "    workers: 1\n", "workers2": f"    workers: {WORKERS}\n"}
SHARD_LABELS = {"none": "no `workers` (forward in the job's process)", "workers1": "`workers: 1`",
                "workers2": f"`workers: {WORKERS}`"}
POOL_CASES = {"easycore": f"easycore {EASYCORE_VERSION} OrderedRunner({WORKERS})",
              "snakeshard": f"snakeshard.pool.OrderedRunner({WORKERS})"}
SHARD_LINE = re.compile(r"^shard 0: (\d+) items(?: \(([\d.]+) s of audio[^)]*\))? in ([\d.]+) s$", re.M)


# -- the hooks both runners share (module level: snakeshard's spawned workers import them from here) --

def asr_init(device, cfg):
    from snakeshard.demo.pocketsphinx_asr import make_decoder

    cfg.decoder = make_decoder()


def asr_work(device, cfg, item):
    import soundfile

    from snakeshard.demo.pocketsphinx_asr import decode

    key, path = item
    samples, rate = soundfile.read(path, dtype="int16")
    assert rate == 16000, (key, rate)
    if cfg.reset:  # the decoder's front end keeps state from the previous utterance: see the module docstring
        cfg.decoder.reinit_feat()
    return key, decode(cfg.decoder, samples)


def collect_init(cfg):
    cfg.results = []


def collect_work(cfg, result):
    cfg.results.append(result)


def collect_end(cfg):
    return cfg.results


class SnakeshardASR(SnakeshardOrderedRunner):
    producer_init, producer_work = staticmethod(asr_init), staticmethod(asr_work)
    consumer_init, consumer_work, consumer_end = staticmethod(collect_init), staticmethod(collect_work), \
        staticmethod(collect_end)


def easycore_asr():
    """easycore's OrderedRunner with the same hooks, and its CfgNode (EASYCORE_DIR on sys.path from here on)."""
    sys.path.insert(0, str(EASYCORE_DIR))  # this case's process only
    from easycore.common.config import CfgNode
    from easycore.common.parallel import OrderedRunner

    class EasycoreASR(OrderedRunner):  # forked workers: the class is never pickled
        producer_init, producer_work = staticmethod(asr_init), staticmethod(asr_work)
        consumer_init, consumer_work, consumer_end = staticmethod(collect_init), staticmethod(collect_work), \
            staticmethod(collect_end)

    return EasycoreASR, CfgNode


def run_case(name: str, data: Path, reset: bool) -> dict:
    """One runner in this process: cold (construct + first call), warm (second call), close; the texts."""
    items = [tuple(line.split(" ", 1)) for line in (data / "wav.scp").read_text().splitlines()]
    if name == "easycore":
        cls, cfg_node = easycore_asr()
        make = lambda: cls(WORKERS, cfg_node({"reset": reset}))  # noqa: E731 (a CfgNode: easycore calls .copy())
    else:
        make = lambda: SnakeshardASR(WORKERS, {"reset": reset})  # noqa: E731
    t0 = time.perf_counter()
    runner = make()
    first = runner(iter(items))
    t1 = time.perf_counter()
    second = runner(iter(items))
    t2 = time.perf_counter()
    runner.close()
    t3 = time.perf_counter()
    first, second = [list(r) for r in first], [list(r) for r in second]
    return {"cold": t1 - t0, "warm": t2 - t1, "close": t3 - t2, "items": len(items), "texts": first,
            "calls_equal": first == second, "cpu": time.process_time() + cpu_children()}


# -- the parent side --

def ensure_easycore() -> str:
    """easycore in EASYCORE_DIR (pip install --no-deps --target), importable there; says what was done."""
    done = ""
    if not (EASYCORE_DIR / f"easycore-{EASYCORE_VERSION}.dist-info").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(EASYCORE_DIR),
               f"easycore=={EASYCORE_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"installing easycore failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        done = f"installed with `{' '.join(cmd[2:])}`; "
    check = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(EASYCORE_DIR)!r}); "
             "import easycore.common.parallel, yaml; print(yaml.__version__)"]
    proc = subprocess.run(check, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"easycore in {EASYCORE_DIR} does not import:\n{proc.stderr[-3000:]}")
    return (f"{done}easycore {EASYCORE_VERSION} in {EASYCORE_DIR.relative_to(REPO)} (--no-deps; its parallel "
            f"module needs only PyYAML, the venv's {proc.stdout.strip()})")


def spawn_case(name: str, data: Path, timeout: float, reset: bool) -> dict:
    """run_case in a fresh interpreter (own process group, killed whole on timeout); its dict, or an error."""
    cmd = [sys.executable, __file__, "--case", name, "--data", str(data)] + ([] if reset else ["--no-reset"])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the case's process and its workers (its own session)
        out, err = proc.communicate()
        return {"error": f"TIMEOUT: no result after {timeout:.0f} s (hung?); process group killed. "
                         f"stderr tail: {err[-1500:]!r}"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.strip():
        return {"error": f"exit code {proc.returncode}: {err[-3000:]}"}
    result = json.loads(out.strip().splitlines()[-1])
    result["process_wall"] = wall
    return result


def make_projects(data: Path, utts: int) -> dict:
    """One project per shard case over one data dir of ``utts`` keys; name -> project dir."""
    shutil.rmtree(WORK, ignore_errors=True)
    make_data(data, utts)
    roots = {}
    for name, workers in SHARD_CASES.items():
        roots[name] = WORK / name / "project"
        copy_workflow(roots[name])
        (roots[name] / "config" / "config.yaml").write_text(CONFIG.format(data=data, workers=workers))
    return roots


def snakemake_job_times(root: Path, output: str) -> tuple[float, float] | None:
    """(starttime, endtime) Snakemake recorded for the job that made ``output`` (.snakemake/metadata)."""
    meta = root / ".snakemake" / "metadata"
    for entry in meta.iterdir() if meta.is_dir() else ():
        name = entry.name
        try:
            decoded = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
        except ValueError:
            continue
        if decoded == output:
            record = json.loads(entry.read_text())
            return record["starttime"], record["endtime"]
    return None


def run_shard_case(root: Path) -> dict:
    wall, cpu = run_snakeshard(root)
    done = json.loads((root / MERGED / "split.0" / "done").read_text())
    log = (root / MERGED / "logs" / "split.0.log").read_text(errors="replace")
    match = SHARD_LINE.search(log)
    if match is None:
        sys.exit(f"no 'shard 0: N items ... in T s' line in {root / MERGED / 'logs' / 'split.0.log'}:\n{log[-2000:]}")
    pool_line = next((line for line in log.splitlines() if line.startswith("shard pool:")), "")
    job = snakemake_job_times(root, str(MERGED / "split.0" / "done"))
    return {"wall": wall, "cpu": cpu, "loop": done["end"] - done["start"], "log_s": float(match[3]),
            "items": int(match[1]), "job": None if job is None else job[1] - job[0], "pool_line": pool_line,
            "text": (root / MERGED / "text").read_bytes()}


def median(values) -> float:
    return statistics.median(values)


def fmt_runs(values, digits=2) -> str:
    return f"{median(values):.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def report_shard(runs: dict, utts: int, audio: float, repeats: int) -> None:
    print(f"\n**shard**: {utts} utterances ({audio:.0f} s of audio) in ONE shard job (`sharding: {{num_shards: 1}}`),"
          f" `snakemake --profile config/profiles/local --cores 2` from a clean state; median of {repeats} "
          "interleaved runs (each run in brackets). Shard loop = the job's `done` end - start (= the log's "
          "`shard 0: N items in T s`; with a pool it includes starting the workers and loading their "
          "decoders); shard job = Snakemake's start..end of the job (process start, env build, pool, loop); "
          "CPU = all of snakemake's child processes\n")
    print("| case | shard loop s | x real time | shard job s | end-to-end wall s | CPU s | speedup, loop "
          "(none / case) | speedup, job | speedup, end-to-end |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {k: median(r[k] for r in runs["none"]) for k in ("loop", "job", "wall")} if runs.get("none") else None
    for name, rs in runs.items():
        if not rs:
            print(f"| {SHARD_LABELS[name]} | no run | | | | | | | |")
            continue
        loop, wall = [r["loop"] for r in rs], [r["wall"] for r in rs]
        job = [r["job"] for r in rs if r["job"] is not None]
        speed = []
        for k, vals in (("loop", loop), ("job", job), ("wall", wall)):
            if base is None or not vals or name == "none":
                speed.append("baseline" if name == "none" else "-")
            else:
                speed.append(f"**{base[k] / median(vals):.2f}x**")
        print(f"| {SHARD_LABELS[name]} | {fmt_runs(loop)} | {audio / median(loop):.1f}x | "
              f"{fmt_runs(job) if job else '-'} | {fmt_runs(wall)} | {median(r['cpu'] for r in rs):.1f} | "
              f"{' | '.join(speed)} |")


def report_pool(runs: dict, utts: int, repeats: int) -> None:
    print(f"\n**easycore**: the same {utts} utterances in-process, {WORKERS} CPU workers each, a fresh "
          f"subprocess per run; median of {repeats} interleaved runs (each run in brackets). cold = "
          "construct the runner + first call (worker start and decoder loading included); warm = a second "
          "call with the workers alive (loading excluded)\n")
    print("| runner | cold s | cold items/s | warm s | warm items/s | close s | CPU s, all processes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rs in runs.items():
        if not rs:
            print(f"| {POOL_CASES[name]} | no run | | | | | |")
            continue
        cold, warm = [r["cold"] for r in rs], [r["warm"] for r in rs]
        print(f"| {POOL_CASES[name]} | {fmt_runs(cold)} | {utts / median(cold):.1f} | {fmt_runs(warm)} | "
              f"{utts / median(warm):.1f} | {median(r['close'] for r in rs):.3f} | {median(r['cpu'] for r in rs):.1f} |")
    if runs.get("easycore") and runs.get("snakeshard"):
        e, s = runs["easycore"], runs["snakeshard"]
        for what in ("cold", "warm"):
            ratio = median(r[what] for r in e) / median(r[what] for r in s)
            print(f"\n- snakeshard / easycore throughput, {what}: **{ratio:.2f}x** (goal >= 1.0x)", end="")
        print()


def text_lines(text: bytes) -> dict:
    return dict(line.split(" ", 1) if " " in line else (line, "") for line in text.decode().splitlines())


def check_texts(shard_runs: dict, pool_runs: dict, data: Path, reset: bool) -> list[str]:
    """The merged texts across shard runs; the runners' (key, text) lists across runs, calls and runners (and
    their order); each merged text against the runners' (which, with the reset, are a fresh decoder's)."""
    lines = []
    texts = [(name, i, r["text"]) for name, rs in shard_runs.items() for i, r in enumerate(rs)]
    if texts:
        ref = texts[0][2]
        bad = [f"{name} run {i} ({sum(a != b for a, b in zip(text_lines(t).items(), text_lines(ref).items()))} "
               "keys)" for name, i, t in texts if t != ref]
        lines.append(f"{'DIFFER' if bad else 'OK'}: merged {MERGED}/text of {len(texts)} shard runs "
                     + (f"differ from the first ({texts[0][0]} run 0): {', '.join(bad)}" if bad
                        else f"byte-identical ({len(ref)} bytes)"))
    keys = [line.split(" ", 1)[0] for line in (data / "wav.scp").read_text().splitlines()]
    outs = [(name, i, r) for name, rs in pool_runs.items() for i, r in enumerate(rs)]
    if outs:
        ref = outs[0][2]["texts"]
        bad = [f"{name} run {i}" for name, i, r in outs if r["texts"] != ref or not r["calls_equal"]]
        order = [k for k, _ in ref] == keys
        lines.append(f"{'FAILED' if bad or not order else 'OK'}: easycore and snakeshard runners "
                     f"({'with' if reset else 'WITHOUT'} reinit_feat per utterance): "
                     + (f"texts differ (or first/second call differ) in {bad}" if bad else
                        f"same {len(ref)} (key, text) pairs, in wav.scp order, in every run and call")
                     + ("" if order else "; NOT in wav.scp order"))
        expected = dict(ref)
        for name, i, t in texts:
            merged = text_lines(t)
            differ = [k for k in keys if merged.get(k) != expected[k]]
            if differ:
                lines.append(f"DIFFER: shard {name} run {i}: {len(differ)} of {len(keys)} keys differ from the "
                             f"in-process texts, e.g. {differ[0]}: {merged.get(differ[0])!r} vs "
                             f"{expected[differ[0]]!r} (decoder state: see the module docstring)")
        if texts and not any(line.startswith("DIFFER: shard") for line in lines):
            lines.append(f"OK: every shard run's merged text equals the in-process texts ({len(keys)} keys)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("shard", "easycore", "all"), default="all")
    ap.add_argument("--utts", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case-timeout", type=float, default=None,
                    help="seconds per easycore-part run (default 60 + 5 s per utterance)")
    ap.add_argument("--case", choices=tuple(POOL_CASES), help="internal: run one runner, print a JSON line")
    ap.add_argument("--data", type=Path, help="internal: the data dir of --case")
    ap.add_argument("--no-reset", action="store_true",
                    help="easycore part: no decoder.reinit_feat() before each utterance (texts then depend on "
                         "which worker decoded what before)")
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.data, not args.no_reset)))
        return

    from importlib.metadata import version

    import snakemake

    from collect_stats import local_slurm

    timeout = args.case_timeout or 60 + 5 * args.utts
    t_start = time.perf_counter()
    parts = ("shard", "easycore") if args.part == "all" else (args.part,)
    versions = {"snakemake": snakemake.__version__, "pocketsphinx": version("pocketsphinx")}
    if "easycore" in parts:
        how = ensure_easycore()
        versions["easycore"] = EASYCORE_VERSION
    print(f"- {machine_info(**versions)}")
    if "easycore" in parts:
        print(f"- {how}")
    data = WORK / "data" / "big"
    roots = make_projects(data, args.utts)
    audio = sum(float(line.split()[1]) for line in (data / "utt2dur").read_text().splitlines())
    cases = ([*SHARD_CASES] if "shard" in parts else []) + ([*POOL_CASES] if "easycore" in parts else [])
    shard_runs = {name: [] for name in SHARD_CASES} if "shard" in parts else {}
    pool_runs = {name: [] for name in POOL_CASES} if "easycore" in parts else {}
    errors = []
    with local_slurm() as slurm:
        print(f"- SLURM controller: {slurm}", flush=True)
        for rep in range(args.repeats):
            for name in rotated(cases, rep):
                if name in SHARD_CASES:
                    r = run_shard_case(roots[name])
                    shard_runs[name].append(r)
                    print(f"  repeat {rep}: {name:10} shard loop {r['loop']:.2f} s (log {r['log_s']:.2f} s), "
                          f"job {r['job'] or float('nan'):.2f} s, end-to-end {r['wall']:.2f} s, CPU {r['cpu']:.1f} s"
                          f"{'; ' + r['pool_line'] if r['pool_line'] else ''}", flush=True)
                else:
                    r = spawn_case(name, data, timeout, not args.no_reset)
                    if "error" in r:
                        errors.append(f"repeat {rep}, {name}: {r['error']}")
                        print(f"  repeat {rep}: {name:10} FAILED: {r['error']}", flush=True)
                        continue
                    pool_runs[name].append(r)
                    print(f"  repeat {rep}: {name:10} cold {r['cold']:.2f} s, warm {r['warm']:.2f} s, "
                          f"close {r['close']:.3f} s, process {r['process_wall']:.2f} s, "
                          f"calls equal: {r['calls_equal']}", flush=True)
    for line in check_texts(shard_runs, pool_runs, data, not args.no_reset):
        print(f"- check: {line}")
    if shard_runs:
        report_shard(shard_runs, args.utts, audio, args.repeats)
    if pool_runs:
        report_pool(pool_runs, args.utts, args.repeats)
    for line in errors:
        print(f"- error: {line}")
    print(f"\n- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"- whole script: {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
