"""Results do not depend on the shard layout: every stage of the shipped config, run unbatched over 1, 2 and 8
shards and, where its forward takes batches, over 2 shards by count and by seconds sorted by length, merges to
the same bytes. A model that carries state from one item to the next (a decoder's running normalisation, an
RNN state kept between calls) gives a key another result when it is the first of a shard, and fails here.

The stages come from config/config.yaml itself, so a stage added to the shipped config is checked too.
"""

from __future__ import annotations

from pathlib import Path

import json

import kaldiio
import numpy as np
import pytest

import yaml
from conftest import PROJECT, copy_workflow, read_config, run_snakemake, write_config

pytestmark = pytest.mark.slow

SHIPPED_STAGES = yaml.safe_load((PROJECT / "config/config.yaml").read_text())["stages"]
SHARD_COUNTS = (1, 2, 8)
# Batchings are checked on 2 shards of the 10 demo keys (batches of 3 + 2 in each: a short batch at every shard's
# end), not on every shard count: 8 shards of 1-2 keys never fill a batch, and 1 shard adds no boundary.
# (Was: every batching on every shard count: 33 shard jobs per batched stage, 15 now.)
BATCHED_SHARDS = 2
BATCHINGS = {"unbatched": {"batch_size": None, "batch_seconds": None, "sort_by_length": False},
             "count3": {"batch_size": 3, "batch_seconds": None, "sort_by_length": False},
             "seconds8sorted": {"batch_size": None, "batch_seconds": 8, "sort_by_length": True}}
# Runners whose forward takes a list of keys although the shipped config does not batch them.
BATCH_AWARE = {"snakeshard.stages.CollectStatsRunner", "snakeshard.stages.ScoringRunner"}
# The one output that is not bit-exact across batchings: torch's batched kernels round differently from
# its single-item ones (silero-vad's per-frame probabilities move by ~1e-6; its segments and wavs do not).
TOLERATED = {("snakeshard.stages.vad.SileroVadRunner", "speech_prob"): 1e-4}
SET_FILES_NOT_COMPARED = {"merged.json", "spec.json", "fingerprints.json", "plan.json", "audio_files.json",
                          "stage_history.json", "summary.html"}  # timings
PATH_FORMATS = ("ark", "npy", "wav", "flac")  # fields whose index lines name files under split.N/


def batchings(stage: dict) -> list[str]:
    batches = stage.get("batch_size") or stage.get("batch_seconds") or stage["runner"] in BATCH_AWARE
    return list(BATCHINGS) if batches else ["unbatched"]


def shapes(stage: dict) -> list[tuple[int, str]]:
    """(shards, batching) of a stage's variants; the first, one shard unbatched, is what the others must equal."""
    return ([(n, "unbatched") for n in SHARD_COUNTS]
            + [(BATCHED_SHARDS, batching) for batching in batchings(stage) if batching != "unbatched"])


def layouts(config: dict) -> dict[str, dict[str, dict]]:
    """Per shipped stage, its variants: name -> stage config (num_shards and batching replaced)."""
    variants = {}
    for name, stage in config["stages"].items():
        variants[name] = {f"{name}_s{n}_{batching}": {**stage, **BATCHINGS[batching], "sharding": {"num_shards": n}}
                          for n, batching in shapes(stage)}
    return variants


def merged_content(set_dir: Path) -> dict[str, object]:
    """What a set's merge produced, independent of where the shards' files lie: every merged file's bytes
    (the set's own path taken out), and for fields stored as files (ark, npy, wav), each key's value."""
    content, indexed = {}, set()
    fields_file = set_dir / "fields.json"
    fields = json.loads(fields_file.read_text()) if fields_file.exists() else {}
    for field, meta in fields.items():
        if meta["format"] not in PATH_FORMATS:
            continue
        indexed.add(meta["index"])
        for line in (set_dir / meta["index"]).read_text().splitlines():
            key, path = line.split(" ", 1)
            if meta["format"] == "ark":
                content[f"{field}:{key}"] = kaldiio.load_mat(path)
            elif meta["format"] == "npy":
                content[f"{field}:{key}"] = np.load(path)
            else:
                content[f"{field}:{key}"] = Path(path).read_bytes()
    for path in sorted(set_dir.iterdir()):
        if path.is_file() and path.name not in SET_FILES_NOT_COMPARED and path.name not in indexed:
            content[path.name] = path.read_bytes().replace(str(set_dir.resolve()).encode(), b"SET")
    return content


def differences(runner: str, base: dict, other: dict) -> list[str]:
    found = [f"{name}: only in one" for name in sorted(set(base) ^ set(other))]
    for name in sorted(set(base) & set(other)):
        want, got = base[name], other[name]
        if isinstance(want, np.ndarray):
            tolerance = TOLERATED.get((runner, name.split(":")[0]))
            same = (want.dtype == got.dtype and want.shape == got.shape
                    and (np.array_equal(want, got) if tolerance is None else np.allclose(want, got, rtol=0, atol=tolerance)))
        else:
            same = want == got
        if not same:
            found.append(name)
    return found


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory):
    wd = copy_workflow(tmp_path_factory.mktemp("layout") / "wf")
    config = read_config(wd)
    shipped = config["stages"]
    variants = layouts(config)
    config["stages"] = {**shipped, **{name: stage for per_stage in variants.values() for name, stage in per_stage.items()}}
    write_config(wd, config)
    run = run_snakemake(wd, "--jobs", "2", timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    return wd, shipped, variants


def test_every_shipped_stage_is_in_the_check(layout_run):
    wd, shipped, variants = layout_run
    assert set(variants) == set(shipped) and len(shipped) >= 5
    for name, stage in shipped.items():
        assert len(variants[name]) == len(SHARD_COUNTS) + len(batchings(stage)) - 1


@pytest.mark.parametrize("stage", list(SHIPPED_STAGES))
def test_merged_outputs_are_the_same_for_1_2_8_shards_and_every_batching_on_2(layout_run, stage):
    wd, shipped, variants = layout_run
    runner = shipped[stage]["runner"]
    for dataset in shipped[stage]["datasets"]:
        names = list(variants[stage])
        base = merged_content(wd / "results" / names[0] / dataset)
        assert base, f"{names[0]}/{dataset} merged nothing"
        for name in names[1:]:
            plan = json.loads((wd / "results" / name / dataset / "plan.json").read_text())
            wanted = variants[stage][name]["sharding"]["num_shards"]
            assert plan["num_shards"] == min(wanted, plan["num_items"]), name
            other = merged_content(wd / "results" / name / dataset)
            assert differences(runner, base, other) == [], f"{name}/{dataset} differs from {names[0]}/{dataset}"


def test_the_demo_decoder_forgets_what_it_heard_before():
    """Every demo utterance decodes to the same text on a fresh decoder and on one that has just decoded
    3 s of loud noise. Without ``reinit_feat()`` in ``decode`` the decoder's live cepstral mean carried over
    and 2 of the 10 keys changed (librivox_austen-0870 and -0890): a key's text depended on which key came
    before it in its shard."""
    from snakeshard import load_dataset
    from snakeshard.demo.pocketsphinx_asr import decode, make_decoder

    dataset = load_dataset({"path": str(PROJECT / "data/demo"), "format": "kaldi"})
    noise = (np.random.default_rng(0).standard_normal(3 * 16000) * 3000).astype(np.int16)
    primed = make_decoder()
    for key in dataset.keys:
        samples, _ = dataset.load_audio(key, dtype="int16")
        decode(primed, noise)
        assert decode(primed, samples) == decode(make_decoder(), samples), key
