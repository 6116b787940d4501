"""The built-in collect-stats stage (snakeshard.stages.CollectStatsRunner), run by real snakemake over the demo.

Reference numbers are computed here independently of the runner: Kaldi fbank of each demo wav (read with
soundfile), all frames of the set stacked, summed once in float64.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import kaldi_native_fbank  # noqa: F401  (the reference below uses it through compute_fbank)
import numpy as np
import pytest
import soundfile as sf

from conftest import PROJECT, copy_workflow, read_config, run_snakemake, shard_process, wait_for, write_config
from snakeshard.errors import ConfigError, ContractError, ShardError
from snakeshard.stages import CollectStatsProvider, CollectStatsRunner, GlobalMVN
from snakeshard.stages.fbank import compute_fbank, fbank_options

DEMO_KEYS = (PROJECT / "data/demo/wav.scp").read_text().split()[::2]
STATS_STAGE = {"runner": "snakeshard.stages.CollectStatsRunner", "provider": "snakeshard.stages.CollectStatsProvider",
               "provider_config": {"num_mel_bins": 80}, "datasets": ["demo"], "sample_rate": 16000,
               "resources": {"mem_mb": 1000, "runtime": 10, "cpus_per_task": 1}}
MODEL_STAGE = {**STATS_STAGE, "provider": "statsmodels.ModelProvider", "provider_config": {"model": "fbank"}}
FILES = ("feats_stats.npz", "feats_lengths_stats.npz", "speech_shape", "batch_keys", "stats_keys")

# A project's own frontends with ESPnet's collect_feats API, and the provider giving ESPnet3's env
# (dataset, model, device; collate_fn left to the default, ESPnet's CommonCollateFn semantics).
MODELS_MODULE = '''
import sys
import time

import torch

from snakeshard import EnvironmentProvider, load_dataset
from snakeshard.stages.fbank import compute_fbank, fbank_options


class KaldiFbankModel(torch.nn.Module):
    """Kaldi fbank of each row of the padded batch: the built-in frontend's features, through the model path."""

    def __init__(self, delay=0.0):
        super().__init__()
        self.opts, self.delay = fbank_options({"num_mel_bins": 80}, 16000), delay

    def collect_feats(self, speech, speech_lengths):
        if self.delay:
            print(f"collect_feats: a batch of {len(speech)}", file=sys.stderr)  # the kill test waits for it
            time.sleep(self.delay * len(speech))
        feats = [torch.from_numpy(compute_fbank((row[:n] * 32768).numpy(), self.opts))
                 for row, n in zip(speech, speech_lengths)]
        return {"feats": torch.nn.utils.rnn.pad_sequence(feats, batch_first=True),
                "feats_lengths": torch.tensor([len(f) for f in feats])}


class StftMelModel(torch.nn.Module):
    """torch.stft (512-point, hop 160, no centering) power spectrum -> 40 triangular mel bands -> log."""

    def __init__(self, floor=1e-10):
        super().__init__()
        self.floor = floor
        mel = lambda hz: 2595 * torch.log10(1 + hz / 700)
        edges = 700 * (10 ** (torch.linspace(mel(torch.tensor(20.0)), mel(torch.tensor(8000.0)), 42) / 2595) - 1)
        bins = torch.linspace(0, 8000, 257)
        lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
        self.fb = torch.clamp(torch.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), min=0).T  # (257, 40)

    def collect_feats(self, speech, speech_lengths):
        spec = torch.stft(speech, n_fft=512, hop_length=160, win_length=400, window=torch.hann_window(400),
                          center=False, return_complex=True).abs() ** 2  # (B, 257, T)
        mel = spec.transpose(1, 2) @ self.fb
        feats = torch.log(mel + self.floor) if self.floor else torch.log(mel)
        return {"feats": feats, "feats_lengths": (speech_lengths - 512) // 160 + 1}


class ModelProvider(EnvironmentProvider):
    def build_env_local(self):
        c = self.config
        model = KaldiFbankModel(c.get("delay", 0.0)) if c["model"] == "fbank" else StftMelModel(c.get("floor", 1e-10))
        return {"dataset": load_dataset(c["dataset"]), "model": model, "device": (c.get("devices") or ["cpu"])[0],
                "write_collected_feats": bool(c.get("write_collected_feats"))}
'''


def reference_frames(keys=DEMO_KEYS) -> np.ndarray:
    """Every frame of ``keys`` (80-dim Kaldi fbank, dither 0), stacked in float64."""
    opts = fbank_options({"num_mel_bins": 80}, 16000)
    frames = []
    for key in keys:
        samples, _ = sf.read(PROJECT / f"data/demo/wav/{key}.wav", dtype="int16")
        frames.append(compute_fbank(samples.astype(np.float32), opts))
    return np.concatenate(frames).astype(np.float64)


def rel_err(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - want) / np.maximum(np.abs(want), 1e-300)))


def stats_project(root: Path, stages: dict, datasets: dict | None = None) -> Path:
    wd = copy_workflow(root)
    (wd / "statsmodels.py").write_text(MODELS_MODULE)
    config = read_config(wd)
    config["datasets"] = datasets or {"demo": config["datasets"]["demo"]}
    config["stages"] = stages
    write_config(wd, config)
    return wd


# -- one snakemake run: shard counts x batchings, the model path, the upstream path, the default sharding --

LAYOUTS = {f"s{n}_b{b}": {"sharding": {"num_shards": n}, "batch_size": b} for n in (1, 3, 7) for b in (1, 8)}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Path:
    stages = {name: {**STATS_STAGE, **layout} for name, layout in LAYOUTS.items()}
    stages["by_seconds_sorted"] = {**STATS_STAGE, "sharding": {"shard_seconds": 12}, "batch_seconds": 8,
                                   "sort_by_length": True}
    stages["default_sharding"] = dict(STATS_STAGE)  # no sharding: the runner's shard_seconds 3600
    stages["model"] = {**MODEL_STAGE, "provider_config": {"model": "fbank", "write_collected_feats": True},
                       "sharding": {"num_shards": 3}, "batch_size": 4}
    stages["builtin_collected"] = {**STATS_STAGE, "provider_config": {"num_mel_bins": 80, "write_collected_feats": True},
                                   "sharding": {"num_shards": 2}}
    stages["fbank"] = {"runner": "snakeshard.stages.fbank.FbankRunner", "provider": "snakeshard.stages.fbank.FbankProvider",
                       "provider_config": {"num_mel_bins": 80}, "datasets": ["demo"], "sample_rate": 16000,
                       "sharding": {"num_shards": 2}}
    stages["upstream"] = {**STATS_STAGE, "provider_config": {"frontend": "upstream"}, "datasets": ["demo_fbank"],
                          "sharding": {"num_shards": 2}}
    # a later stage normalizing with the stats: fbank + GlobalMVN over the stats stage's output
    stages["fbank_mvn"] = {**stages["fbank"], "provider_config": {"num_mel_bins": 80, "global_mvn": True},
                           "datasets": ["demo_stats"]}
    datasets = {"demo": {"path": "data/demo", "format": "kaldi"},
                "demo_fbank": {"from_stage": "fbank", "dataset": "demo"},
                "demo_stats": {"from_stage": "s3_b8", "dataset": "demo"}}
    wd = stats_project(tmp_path_factory.mktemp("stats") / "wf", stages, datasets)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    return wd


def set_dir(wd: Path, stage: str, dataset: str = "demo") -> Path:
    return wd / "results" / stage / dataset


@pytest.mark.parametrize("stage", [*LAYOUTS, "by_seconds_sorted", "default_sharding"])
def test_stats_equal_a_float64_reference_for_any_shard_count_and_batching(matrix, stage):
    """1, 3, 7 shards x batch sizes 1, 8, and shards by seconds with sorted dynamic batches: the merged
    feats_stats.npz is float64 sums within 1e-12 of one float64 sum over every frame of the set; count (int64)
    is the exact frame count; feats_lengths_stats holds utterances, frames, and squared frame counts."""
    frames = reference_frames()
    lengths = np.array([len(f) for f in map(reference_frames, ([k] for k in DEMO_KEYS))], dtype=np.float64)
    with np.load(set_dir(matrix, stage) / "feats_stats.npz") as stats:
        assert sorted(stats.files) == ["count", "sum", "sum_square"]
        assert stats["count"].dtype == np.int64 and stats["count"] == len(frames) == 3418
        assert stats["sum"].dtype == stats["sum_square"].dtype == np.float64 and stats["sum"].shape == (80,)
        assert rel_err(stats["sum"], frames.sum(0)) <= 1e-12
        assert rel_err(stats["sum_square"], (frames ** 2).sum(0)) <= 1e-12
    with np.load(set_dir(matrix, stage) / "feats_lengths_stats.npz") as stats:
        assert stats["count"] == 10 and stats["sum"] == lengths.sum() and stats["sum_square"] == (lengths ** 2).sum()


def test_stats_are_the_same_for_every_layout(matrix):
    """Every layout's merged npz holds the same numbers (within 1e-12; in fact byte-identical here)."""
    with np.load(set_dir(matrix, "s1_b1") / "feats_stats.npz") as base:
        for stage in [*LAYOUTS, "by_seconds_sorted", "default_sharding", "model", "builtin_collected"]:
            with np.load(set_dir(matrix, stage) / "feats_stats.npz") as other:
                for name in ("sum", "sum_square"):
                    assert rel_err(other[name], base[name]) <= 1e-12, (stage, name)


def test_shape_files_and_key_lists_as_espnet2_writes_them(matrix):
    """speech_shape: one `key samples` line per key, in the dataset's order, the frame count soundfile reports;
    batch_keys and stats_keys: exact text. Each split.N has the same files for its own keys."""
    for stage in ("s7_b8", "by_seconds_sorted", "model"):
        out = set_dir(matrix, stage)
        expected = "".join(f"{k} {sf.info(PROJECT / f'data/demo/wav/{k}.wav').frames}\n" for k in DEMO_KEYS)
        assert (out / "speech_shape").read_text() == expected
        assert (out / "batch_keys").read_text() == "speech\n"
        assert (out / "stats_keys").read_text() == "feats\nfeats_lengths\n"
        splits = sorted(out.glob("split.*"), key=lambda p: int(p.name.split(".")[1]))
        assert "".join((s / "speech_shape").read_text() for s in splits) == expected
        for split in splits:
            assert {f for f in FILES if (split / f).exists()} == set(FILES)


def test_shards_aggregate_as_espnet2_aggregate_stats_dirs_would(matrix):
    """The split dirs, aggregated the way ESPnet2's aggregate_stats_dirs.py does (keys from the first dir;
    shape lines concatenated, sorted by key within each dir; each npz array summed dir by dir), give the
    merged files (shape files compared as key -> shape mappings, as ESPnet2's samplers read them; sums to
    1e-12, count exactly)."""
    out = set_dir(matrix, "s7_b1")
    splits = [out / f"split.{n}" for n in range(7)]
    batch_keys = (splits[0] / "batch_keys").read_text().split()
    stats_keys = (splits[0] / "stats_keys").read_text().split()
    assert batch_keys == ["speech"] and stats_keys == ["feats", "feats_lengths"]
    for key in batch_keys:
        lines = [line for s in splits for line in sorted((s / f"{key}_shape").read_text().splitlines(True))]
        assert dict(line.split() for line in lines) == dict(line.split() for line in (out / f"{key}_shape").read_text().splitlines())
    for key in stats_keys:
        total = None
        for split in splits:
            with np.load(split / f"{key}_stats.npz") as part:
                total = dict(part) if total is None else {k: total[k] + part[k] for k in part.files}
        # ESPnet2 adds the shards' rounded float64 sums; the merge adds their exact sums and rounds once:
        # the same numbers up to the last bits
        with np.load(out / f"{key}_stats.npz") as merged:
            assert sorted(merged.files) == sorted(total) == ["count", "sum", "sum_square"]
            assert merged["count"] == total["count"] and merged["count"].dtype == np.int64
            for name in ("sum", "sum_square"):
                assert merged[name].dtype == np.float64 and rel_err(merged[name], total[name]) <= 1e-12


def test_model_collect_feats_path_gives_the_built_in_stats(matrix):
    """A torch module with ESPnet's collect_feats(speech, speech_lengths) computing Kaldi fbank, on padded batches
    of 4 (collate_fn: the default, ESPnet's CommonCollateFn semantics): the same statistics as the built-in frontend."""
    for name in FILES:
        if name.endswith(".npz"):
            with np.load(set_dir(matrix, "model") / name) as got, np.load(set_dir(matrix, "s1_b1") / name) as want:
                assert got["count"] == want["count"]
                assert rel_err(got["sum"], want["sum"]) <= 1e-12 and rel_err(got["sum_square"], want["sum_square"]) <= 1e-12
        else:
            assert (set_dir(matrix, "model") / name).read_text() == (set_dir(matrix, "s1_b1") / name).read_text()


@pytest.mark.parametrize("stage", ["model", "builtin_collected"])
def test_collected_feats_round_trip_through_numpy(matrix, stage):
    """write_collected_feats: collect_feats/feats.scp and feats_lengths.scp (ESPnet2's layout, one .npy per key,
    absolute paths) in every shard and merged; each feats array equals the key's Kaldi fbank; lengths are (1,)."""
    out = set_dir(matrix, stage)
    scp = dict(line.split() for line in (out / "collect_feats/feats.scp").read_text().splitlines())
    assert list(scp) == DEMO_KEYS
    for key, path in scp.items():
        assert Path(path).is_absolute() and path.endswith(f"/collect_feats/feats/{key}.npy")
        feats = np.load(path)
        assert feats.dtype == np.float32 and np.array_equal(feats, reference_frames([key]).astype(np.float32))
    lengths = dict(line.split() for line in (out / "collect_feats/feats_lengths.scp").read_text().splitlines())
    assert np.load(lengths["cards-001"]).tolist() == [len(np.load(scp["cards-001"]))]
    assert (out / "split.1/collect_feats/feats.scp").exists()


def test_upstream_features_give_the_same_stats(matrix):
    """Stats over a chained dataset's `feats` (the fbank stage's merged ark): equal numbers to the built-in
    frontend; speech_shape holds each key's feature matrix shape, as ESPnet2 writes it for extracted features."""
    out = set_dir(matrix, "upstream", "demo_fbank")
    with np.load(out / "feats_stats.npz") as got, np.load(set_dir(matrix, "s1_b1") / "feats_stats.npz") as want:
        assert got["count"] == want["count"] and rel_err(got["sum"], want["sum"]) <= 1e-12
    frames = dict(line.split() for line in (set_dir(matrix, "fbank") / "utt2num_frames").read_text().splitlines())
    assert (out / "speech_shape").read_text() == "".join(f"{k} {frames[k]},80\n" for k in DEMO_KEYS)


def test_default_sharding_is_by_audio_seconds_and_the_log_counts_seconds(matrix):
    """A stats stage without `sharding` is planned with the runner's default (shard_seconds 3600: the 34 s demo
    is one shard); a shard job's log gives its items and audio seconds, in lines."""
    import json

    plan = json.loads((set_dir(matrix, "default_sharding") / "plan.json").read_text())
    assert plan["num_shards"] == 1 and plan["sharding"] == {"shard_seconds": 3600}
    log = (set_dir(matrix, "by_seconds_sorted") / "logs/split.0.log").read_text()
    assert re.search(r"shard 0: \d+ items \(\d+\.\d s of audio, \d+x real time\) in \d+\.\d\d s", log), log
    assert "\r" not in log  # progress is lines (snakeshard.core.progress, every 10 s: tests/test_job_overhead.py), not a redrawn bar


def test_global_mvn_normalizes_like_espnet2(matrix):
    """GlobalMVN over the merged stats: mean and std (ESPnet2's formula) equal numpy's over all frames; normalized
    frames have mean 0 and std 1 per dim; a set dir or the npz path both work; the dtype is kept."""
    frames = reference_frames()
    mvn = GlobalMVN(set_dir(matrix, "s3_b8"))
    assert rel_err(mvn.mean, frames.mean(0)) <= 1e-12 and rel_err(mvn.std, frames.std(0)) <= 1e-9
    out = mvn(frames.astype(np.float32))
    assert out.dtype == np.float32
    assert np.abs(out.mean(0)).max() < 1e-4 and np.abs(out.std(0) - 1).max() < 1e-4
    assert np.array_equal(GlobalMVN(set_dir(matrix, "s3_b8") / "feats_stats.npz").std, mvn.std)


def test_a_later_stage_normalizes_with_the_stats(matrix):
    """fbank with global_mvn: true over {from_stage: s3_b8}: each key's features are its Kaldi fbank through
    GlobalMVN of that stage's feats_stats.npz; over the whole set, every dim has mean 0 and std 1."""
    import kaldiio

    mvn = GlobalMVN(set_dir(matrix, "s3_b8"))
    feats = kaldiio.load_scp(str(set_dir(matrix, "fbank_mvn", "demo_stats") / "feats.scp"))
    for key in DEMO_KEYS:
        assert np.array_equal(feats[key], mvn(reference_frames([key]).astype(np.float32)))
    frames = np.concatenate([feats[k] for k in DEMO_KEYS]).astype(np.float64)
    assert np.abs(frames.mean(0)).max() < 1e-4 and np.abs(frames.std(0) - 1).max() < 1e-4


def test_a_global_mvn_stage_waits_for_the_stats_merge_and_reruns_when_any_stats_shard_changes(tmp_path):
    """The statistics are summed over every upstream key: each shard job of a global_mvn stage waits for the stats
    stage's merge (not only for the stats shards over its own keys; found when a shard job ran before the merge had
    written feats_stats.npz and failed), and keys appended to the data, landing in the last stats shard only,
    rerun every normalizing shard, with the new statistics."""
    import kaldiio

    stages = {"stats": {**STATS_STAGE, "sharding": {"num_shards": 3}},
              "mvn": {"runner": "snakeshard.stages.fbank.FbankRunner",
                      "provider": "snakeshard.stages.fbank.FbankProvider",
                      "provider_config": {"num_mel_bins": 80, "global_mvn": True}, "datasets": ["demo_stats"],
                      "sample_rate": 16000, "sharding": {"num_shards": 2}}}
    data = tmp_path / "data"
    shutil.copytree(PROJECT / "data/demo", data)
    datasets = {"demo": {"path": str(data), "format": "kaldi"},
                "demo_stats": {"from_stage": "stats", "dataset": "demo"}}
    wd = stats_project(tmp_path / "wf", stages, datasets)
    plan = run_snakemake(wd, "-n")
    assert plan.returncode == 0, plan.stderr[-2000:]
    jobs = re.findall(r"rule shard_mvn:\n((?:    .*\n)+)", plan.stdout)
    assert len(jobs) == 2 and all("results/stats/demo/merged.json" in job for job in jobs), plan.stdout[-3000:]
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]

    appended = DEMO_KEYS[0]  # a copy of the first recording under a new key, last in wav.scp: the last stats shard
    with open(data / "wav.scp", "a") as scp:
        scp.write(f"zz-copy {data}/wav/{appended}.wav\n")
    plan = run_snakemake(wd, "-n")
    assert plan.returncode == 0, plan.stderr[-2000:]
    counts = dict(re.findall(r"^(shard_\w+)\s+(\d+)$", plan.stdout, re.M))
    assert counts == {"shard_stats": "1", "shard_mvn": "2"}, plan.stdout[-3000:]
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    mvn = GlobalMVN(set_dir(wd, "stats"))
    feats = kaldiio.load_scp(str(set_dir(wd, "mvn", "demo_stats") / "feats.scp"))
    assert np.array_equal(feats[DEMO_KEYS[1]], mvn(reference_frames([DEMO_KEYS[1]]).astype(np.float32)))


def test_a_users_provider_declares_the_options_that_read_the_upstream_merge(tmp_path):
    """A project's own provider says which of its provider_config options read the upstream merge
    (``reads_upstream_merge``, annotated or not): with the option set its shard jobs wait for the merge, without it
    for the upstream shards only; a declaration that is not a tuple of names is refused at parse, naming the key."""
    stages = {"stats": {**STATS_STAGE, "sharding": {"num_shards": 3}},
              "norm": {"runner": "snakeshard.stages.fbank.FbankRunner", "provider": "mynorm.NormProvider",
                       "provider_config": {"num_mel_bins": 80, "normalize": True}, "datasets": ["demo_stats"],
                       "sample_rate": 16000, "sharding": {"num_shards": 2}}}
    datasets = {"demo": {"path": "data/demo", "format": "kaldi"},
                "demo_stats": {"from_stage": "stats", "dataset": "demo"}}
    wd = stats_project(tmp_path / "wf", stages, datasets)
    module = wd / "mynorm.py"
    declared = "from snakeshard.stages.fbank import FbankProvider\n\n\nclass NormProvider(FbankProvider):\n    {}\n"

    def shard_inputs(declaration: str, normalize: bool = True) -> list[str]:
        module.write_text(declared.format(declaration or "pass"))
        config = read_config(wd)
        config["stages"]["norm"]["provider_config"]["normalize"] = normalize
        write_config(wd, config)
        plan = run_snakemake(wd, "-n")
        assert plan.returncode == 0, plan.stderr[-2000:]
        return re.findall(r"rule shard_norm:\n((?:    .*\n)+)", plan.stdout)

    jobs = shard_inputs('reads_upstream_merge: tuple[str, ...] = ("normalize",)')
    assert len(jobs) == 2 and all("results/stats/demo/merged.json" in job for job in jobs)
    jobs = shard_inputs('reads_upstream_merge: tuple[str, ...] = ("normalize",)', normalize=False)
    assert len(jobs) == 2 and not any("merged.json" in job for job in jobs)
    jobs = shard_inputs("")
    assert len(jobs) == 2 and not any("merged.json" in job for job in jobs)

    module.write_text(declared.format('reads_upstream_merge = "normalize"'))
    plan = run_snakemake(wd, "-n")
    assert plan.returncode != 0
    assert ("stages.norm.provider: mynorm.NormProvider.reads_upstream_merge is 'normalize': a tuple of "
            "provider_config option names") in plan.stderr, plan.stderr[-2000:]


def test_global_mvn_needs_a_stats_stage_output():
    from snakeshard.stages.fbank import FbankProvider

    with pytest.raises(ConfigError, match=r"provider_config.global_mvn: dataset 'demo' must be a collect-stats "
                                          r"stage's output .*no feats_stats.npz"):
        FbankProvider({"dataset": demo_spec(), "global_mvn": True}).build_env_local()


def test_global_mvn_floors_the_variance(tmp_path):
    """A constant feature dim (variance 0, or slightly negative from rounding): std is sqrt(1e-20), not NaN."""
    from snakeshard.stages.collect_stats import stats_npz_bytes

    (tmp_path / "feats_stats.npz").write_bytes(stats_npz_bytes(4, [8.0, 4.0], [16.0, 4.0 - 1e-15]))
    mvn = GlobalMVN(tmp_path)
    assert mvn.mean.tolist() == [2.0, 1.0] and mvn.std.tolist() == [1e-10, 1e-10]


# -- a torch STFT + mel frontend; a NaN from it fails its shard --

def test_stft_mel_model_and_a_nonfinite_feature(tmp_path):
    """A torch STFT + log-mel module through collect_feats on padded batches: stats within 1e-6 of the same module
    applied to each utterance alone (float32 kernels round differently per batch shape), shapes from the padded
    batch trimmed by speech_lengths. The same module without a log floor gives -inf on a silent key: its shard
    fails naming key, feature, frame; the other shards keep their done; nothing is merged for that stage."""
    import torch

    data = tmp_path / "data"
    data.mkdir()
    sf.write(data / "silence.wav", np.zeros(16000, dtype=np.int16), 16000)
    keys = [*DEMO_KEYS[:5], "silence", *DEMO_KEYS[5:]]
    (data / "wav.scp").write_text("".join(
        f"{k} {data / 'silence.wav' if k == 'silence' else PROJECT / f'data/demo/wav/{k}.wav'}\n" for k in keys))
    stages = {"mel": {**MODEL_STAGE, "provider_config": {"model": "mel"}, "datasets": ["silent"],
                      "sharding": {"num_shards": 2}, "batch_size": 3},
              "mel_nofloor": {**MODEL_STAGE, "provider_config": {"model": "mel", "floor": 0}, "datasets": ["silent"],
                              "sharding": {"num_shards": 3}, "batch_size": 3}}
    wd = stats_project(tmp_path / "wf", stages, {"silent": {"path": str(data), "format": "kaldi"}})
    run = run_snakemake(wd)
    assert run.returncode != 0
    assert re.search(r"shard 1 \(log: [^)]*\): item 'silence': feature 'feats' holds -inf at frame 0, dim \(0,\)", run.stderr)
    nofloor = wd / "results/mel_nofloor/silent"
    assert (nofloor / "split.0/done").exists() and (nofloor / "split.2/done").exists()
    assert not (nofloor / "split.1/done").exists() and not (nofloor / "merged.json").exists()

    sys.path.insert(0, str(wd))
    try:
        from statsmodels import StftMelModel
    finally:
        sys.path.remove(str(wd))
    model, rows = StftMelModel(), []
    for key in keys:
        path = data / "silence.wav" if key == "silence" else PROJECT / f"data/demo/wav/{key}.wav"
        samples, _ = sf.read(path, dtype="float32")
        out = model.collect_feats(torch.from_numpy(samples)[None], torch.tensor([len(samples)]))
        rows.append(out["feats"][0, :int(out["feats_lengths"][0])].numpy().astype(np.float64))
    frames = np.concatenate(rows)
    with np.load(wd / "results/mel/silent/feats_stats.npz") as stats:
        assert stats["count"] == len(frames)
        assert rel_err(stats["sum"], frames.sum(0)) <= 1e-6 and rel_err(stats["sum_square"], (frames ** 2).sum(0)) <= 1e-6
    shapes = dict(line.split() for line in (wd / "results/mel/silent/speech_shape").read_text().splitlines())
    assert shapes["silence"] == "16000" and shapes[DEMO_KEYS[0]] == str(sf.info(PROJECT / f"data/demo/wav/{DEMO_KEYS[0]}.wav").frames)


# -- kill -9 --

def test_kill9_mid_shard_then_rerun_gives_byte_identical_stats(tmp_path):
    """A shard job killed with -9 mid-run (the model path, 0.5 s per key, once its first batch started): no done, no merge; the rerun's merged
    npz, shape and key files equal an uninterrupted run's in another directory, byte for byte."""
    stage = {**MODEL_STAGE, "provider_config": {"model": "fbank", "delay": 0.5}, "fingerprint_ignore": ["delay"],
             "sharding": {"num_shards": 2}}
    clean = stats_project(tmp_path / "clean", {"stats": stage})
    assert run_snakemake(clean).returncode == 0
    wd = stats_project(tmp_path / "wf", {"stats": stage})
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"],
                              cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = wait_for(lambda: shard_process(wd, 0), 60, "shard 0 to start")
    log = wd / "results/stats/demo/logs/split.0.log"
    wait_for(lambda: log.exists() and "collect_feats: a batch" in log.read_text(), 60, "shard 0's first batch")
    victim.send_signal(signal.SIGKILL)
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode != 0, out
    out_dir = wd / "results/stats/demo"
    assert not (out_dir / "split.0/done").exists() and not (out_dir / "merged.json").exists()
    assert run_snakemake(wd).returncode == 0
    for name in FILES:
        assert (out_dir / name).read_bytes() == (clean / "results/stats/demo" / name).read_bytes(), name


# -- bad input and config, in-process --

def demo_spec(**extra) -> dict:
    return {"name": "demo", "path": str(PROJECT / "data/demo"), "format": "kaldi", "sample_rate": 16000, **extra}


@pytest.mark.parametrize("config, message", [
    ({"frontend": "mfcc"}, "stages.<stage>.provider_config.frontend: 'mfcc' is not a built-in frontend (fbank, upstream)"),
    ({"num_mel_bin": 80}, "stages.<stage>.provider_config.num_mel_bin: not a fbank option"),
    ({"frontend": "upstream"}, "'upstream' reads features another stage wrote, or a Kaldi data dir's feats.scp "
                               "(feats_field: feats): dataset 'demo' must be a chained one ({from_stage: ..., dataset: "
                               "...}) or a data dir with a feats.scp"),
    ({"frontend": "upstream", "num_mel_bins": 80}, "provider_config.num_mel_bins: frontend 'upstream' takes only feats_field"),
])
def test_provider_config_errors_name_the_key(config, message):
    with pytest.raises(ConfigError) as e:
        CollectStatsProvider({**config, "dataset": demo_spec()}).build_env_local()
    assert message in str(e.value)


def run_in_process(env: dict, keys: list[str], shard_dir: Path, **options):
    from snakeshard.core.shard import run_shard

    return run_shard(CollectStatsRunner, env, keys, shard_dir, progress=False, **options)


class OneDimFrontend:
    """Returns features of another width for one key (a frontend whose config changed mid-shard)."""

    def __call__(self, keys, dataset):
        return [({"speech": (10,)}, {"feats": np.ones((3, 40 if k == "b" else 80), np.float32)}) for k in keys]


def test_a_feature_of_another_width_fails_naming_the_key(tmp_path):
    with pytest.raises(ShardError, match=r"shard 0: item 'b': feature 'feats' has frames of shape \(40,\), earlier keys \(80,\)"):
        run_in_process({"dataset": None, "frontend": OneDimFrontend()}, ["a", "b"], tmp_path / "split.0")
    assert not (tmp_path / "split.0/done").exists()


def test_env_without_frontend_or_model_is_a_contract_error(tmp_path):
    with pytest.raises(ShardError, match="CollectStatsRunner needs env 'frontend' .* or 'model'"):
        run_in_process({"dataset": None}, ["a"], tmp_path / "split.0")
    with pytest.raises(ShardError, match=r"the env's model \(object\) has no collect_feats"):
        run_in_process({"dataset": None, "model": object()}, ["a"], tmp_path / "split.1")


def test_stage_without_sharding_takes_the_runners_default_else_eight_shards(tmp_path):
    """validate_config fills a missing sharding from the runner's default_sharding (read from its source, the
    class found through the package's re-export); a runner without one gets 8 shards (several per core)."""
    from snakeshard.workflow.parse import validate_config

    config = {"datasets": {"demo": {"path": "data/demo"}},
              "stages": {"stats": {k: v for k, v in STATS_STAGE.items() if k != "resources"}}}
    validate_config(config)
    assert config["stages"]["stats"]["sharding"] == {"shard_seconds": 3600}
    config["stages"]["fbank"] = {"runner": "snakeshard.stages.fbank.FbankRunner",
                                 "provider": "snakeshard.stages.fbank.FbankProvider", "datasets": ["demo"]}
    validate_config(config)
    assert config["stages"]["fbank"]["sharding"] == {"num_shards": 8, "max_shard_items": 100000}
    config["stages"]["fbank"]["sharding"] = {"shard_size": 3}  # an explicit setting stands
    validate_config(config)
    assert config["stages"]["fbank"]["sharding"] == {"shard_size": 3}


def test_code_fingerprint_follows_the_reexport():
    """`snakeshard.stages.CollectStatsRunner` digests collect_stats.py (where the class is defined), not the
    package's __init__.py: editing the runner reruns its stages."""
    from snakeshard.core.user_source import source_digest

    assert (source_digest("snakeshard.stages.CollectStatsRunner", "x")
            == source_digest("snakeshard.stages.collect_stats.CollectStatsRunner", "x")
            != source_digest("snakeshard.stages.fbank.FbankRunner", "x"))


def test_in_process_run_returns_shapes_and_features():
    """Without an output dir, the runner returns per key its input shapes and trimmed features (for notebooks)."""
    results = CollectStatsRunner(CollectStatsProvider({"dataset": demo_spec(), "num_mel_bins": 80}))(DEMO_KEYS[:2])
    assert [r["key"] for r in results] == DEMO_KEYS[:2]
    assert results[0]["shapes"] == {"speech": str(sf.info(PROJECT / f"data/demo/wav/{DEMO_KEYS[0]}.wav").frames)}
    assert np.array_equal(results[0]["stats"]["feats"], reference_frames(DEMO_KEYS[:1]).astype(np.float32))
    assert results[0]["stats"]["feats_lengths"].tolist() == [len(results[0]["stats"]["feats"])]


def test_grouped_field_names_cannot_clash(tmp_path):
    """A field `g/x` lives in dir g: a field named `g` in the same shard is refused, naming both."""
    from snakeshard.io.writers import FieldWriters

    writers = FieldWriters(tmp_path)
    writers.write({"key": "a", "collect_feats/feats": "1"})
    with pytest.raises(ContractError, match="field 'collect_feats' and field 'collect_feats/feats' cannot both exist"):
        writers.write({"key": "a", "collect_feats": "2"})


def test_dataerror_names_frame_and_dim():
    from snakeshard.stages.collect_stats import _first_nonfinite

    seq = np.zeros((4, 3))
    seq[2, 1] = np.nan
    assert _first_nonfinite(seq) == "holds nan at frame 2, dim (1,)"


class WideFrontend:
    """One more feature than the built-in frontend returns (another frontend in another shard)."""

    def __call__(self, keys, dataset):
        return [({"speech": (10,)}, {"feats": np.ones((3, 80), np.float32), "feats_lengths": np.array([3]),
                                     "energy": np.ones((3, 1), np.float32)}) for _ in keys]


def test_merge_refuses_shards_that_saw_other_features(tmp_path):
    """Two shards whose stats_keys differ (feats, feats_lengths vs + energy): the merge names both files and
    writes no stats."""
    from snakeshard.errors import MergeError

    env = CollectStatsProvider({"dataset": demo_spec(), "num_mel_bins": 80}).build_env_local()
    run_in_process(env, DEMO_KEYS[:2], tmp_path / "split.0")
    run_in_process({**env, "frontend": WideFrontend()}, DEMO_KEYS[2:4], tmp_path / "split.1")
    with pytest.raises(MergeError, match=rf"{tmp_path}/split.1/stats_keys differs from {tmp_path}/split.0/stats_keys"):
        CollectStatsRunner.merge([tmp_path / "split.0", tmp_path / "split.1"], tmp_path)
    assert not (tmp_path / "feats_stats.npz").exists()


class TinyModel:
    def collect_feats(self, speech, speech_lengths):
        return {"feats": speech[:, :, None], "feats_lengths": speech_lengths}


def test_model_path_contract_errors(tmp_path):
    """A collate_fn that reorders the batch, and load_inputs giving keys different inputs: errors naming why."""
    from snakeshard.stages.collect_stats import common_collate_fn

    def reversed_collate(items):
        keys, batch = common_collate_fn(items)
        return keys[::-1], batch

    env = {"dataset": None, "model": TinyModel(), "load_inputs": lambda key: {"speech": np.ones(4, np.float32)}}
    with pytest.raises(ShardError, match=r"collate_fn returned keys \['b', 'a'\]... for \['a', 'b'\]...: it must keep"):
        run_in_process({**env, "collate_fn": reversed_collate}, ["a", "b"], tmp_path / "split.0", batch_size=2)
    odd = {**env, "load_inputs": lambda key: {"speech": np.ones(4, np.float32), **({"text": np.ones(2)} if key == "b" else {})}}
    with pytest.raises(ShardError, match=r"item 'b': load_inputs gave \['speech', 'text'\], the batch's first key \['speech'\]"):
        run_in_process(odd, ["a", "b"], tmp_path / "split.1", batch_size=2)


def test_global_mvn_refuses_stats_of_another_width(tmp_path):
    """Stats of 80-dim features applied to a 40-bin fbank stage: an error naming both widths, not a broadcast."""
    from types import SimpleNamespace

    from snakeshard.stages.collect_stats import stats_npz_bytes
    from snakeshard.stages.fbank import _global_mvn

    (tmp_path / "feats_stats.npz").write_bytes(stats_npz_bytes(2, np.zeros(80), np.ones(80)))
    with pytest.raises(ConfigError, match=r"feats_stats.npz has \(80,\) dims, this stage's fbank 40"):
        _global_mvn(SimpleNamespace(set_dir=tmp_path, spec={"name": "x"}), 40)
