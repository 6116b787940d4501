"""Feature statistics and shape files, as ESPnet2's ``collect_stats`` + ``aggregate_stats_dirs.py`` write them.

Per dataset (ESPnet's ``train``/``valid`` modes are datasets here), the merged dir holds:

  <feat>_stats.npz   ``count`` (int64), ``sum`` and ``sum_square`` (float64, per feature dim) for every
                     array the frontend returns, ``feats_lengths`` included (count: utterances,
                     sum: frames), as ESPnet2 accumulates them
  <input>_shape      ``key d1[,d2...]`` per key for every batch input, trimmed by its ``_lengths``
                     (``speech_shape``: ``utt1 52000``), in plan order (the input's)
  batch_keys         the batch inputs (no ``_lengths``), one per line
  stats_keys         every statistics key, one per line
  collect_feats/<feat>.scp + .npy files   with ``write_collected_feats: true`` (ESPnet2 writes npy)

Each ``split.N/`` holds the same files for its keys (the layout of one of ESPnet2's ``stats.N/<mode>``
dirs). Each key's frames are summed in float64; the keys' sums are then added exactly (``ExactSum``: per
shard in ``reduce_state``, across shards in ``merge``, from each shard's ``exact_sums.json``) and rounded
once, so the merged npz is the same bytes for any shard count or batching. ESPnet2 accumulates in the
features' own dtype (float32).

Frontends (what turns a key into features):
  fbank     (default) Kaldi fbank with kaldi-native-fbank; ``provider_config`` takes Kaldi's options
            (see stages/fbank.py; dither 0). Batch input ``speech`` (samples).
  upstream  an upstream stage's array field (``feats_field``, default ``feats``) over a chained
            dataset (``{from_stage: fbank, dataset: train}``). Batch input ``speech`` (frames, dims),
            as ESPnet2 names extracted features.
  model     your provider's env gives ESPnet3's contract: ``model`` with ``collect_feats(**batch)``,
            optional ``collate_fn`` (default: ``common_collate_fn``, ESPnet's CommonCollateFn), ``device``,
            ``load_inputs(key) -> {name: array}`` (default ``{"speech": float32 samples}``) and
            ``collect_stats_kwargs``; run on padded batches under ``torch.no_grad()``.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

from snakeshard import BaseRunner, InferenceProvider
from snakeshard.errors import ConfigError, ContractError, DataError, MergeError
from snakeshard.stages.global_mvn import GlobalMVN  # noqa: F401  (its home until global_mvn.py; users import it from here)

COLLECTED = "collect_feats"  # ESPnet2's dir of collected features
BATCH_KEYS, STATS_KEYS = "batch_keys", "stats_keys"
EXACT_SUMS = "exact_sums.json"  # per shard: the exact sums the merge adds (the npz holds them rounded)


# -- frontends: keys -> per key (input shapes, features) --

class FbankFrontend:
    """Kaldi fbank of each key's audio (16-bit integer scale, as Kaldi reads wavs)."""

    def __init__(self, options):
        self.options = options

    def __call__(self, keys, dataset) -> list[tuple[dict, dict]]:
        from snakeshard.stages.fbank import fbank_of

        return [_speech_and_feats(samples.shape, feats)
                for samples, feats in (fbank_of(dataset, key, self.options) for key in keys)]


class UpstreamFrontend:
    """Features an upstream stage computed: its array field ``field`` (ark or npy) over a chained dataset."""

    def __init__(self, field: str):
        self.field = field

    def __call__(self, keys, dataset) -> list[tuple[dict, dict]]:
        return [_speech_and_feats(feats.shape, feats) for feats in (dataset.load_array(k, self.field) for k in keys)]


def _speech_and_feats(speech_shape: tuple, feats) -> tuple[dict, dict]:
    """A built-in frontend's result for one key, as ESPnet2 names them: the batch input ``speech`` (its
    shape) and what collect_feats would return, ``feats`` and ``feats_lengths``."""
    import numpy as np

    return {"speech": speech_shape}, {"feats": feats, "feats_lengths": np.array([len(feats)])}


class ModelFrontend:
    """ESPnet's ``model.collect_feats(**batch)`` on one padded batch (``collate_fn``), on ``device``."""

    def __init__(self, model, collate_fn=None, device="cpu", load_inputs=None, collect_stats_kwargs=None):
        if not callable(getattr(model, "collect_feats", None)):
            raise ContractError(f"the env's model ({type(model).__name__}) has no collect_feats(**batch) method")
        self.model, self.collate_fn = model, collate_fn or common_collate_fn
        self.device, self.load_inputs, self.kwargs = device, load_inputs, collect_stats_kwargs or {}

    def __call__(self, keys, dataset) -> list[tuple[dict, dict]]:
        import torch

        load = self.load_inputs or (lambda key: {"speech": dataset.load_audio(key, dtype="float32")[0]})
        uttids, batch = self.collate_fn([(key, load(key)) for key in keys])
        if list(uttids) != list(keys):
            raise ContractError(f"collate_fn returned keys {list(uttids)[:3]}... for {list(keys)[:3]}...: it must "
                                "keep the batch's keys and order")
        # as ESPnet2: only tensors go to the model (structured items are dropped)
        batch = {k: v.to(self.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            feats = self.model.collect_feats(**batch, **self.kwargs)
        shapes = [{} for _ in keys]
        for name, data in batch.items():
            if name.endswith("_lengths"):
                continue
            for i, row in enumerate(data):
                if f"{name}_lengths" in batch:
                    row = row[:int(batch[f"{name}_lengths"][i])]
                shapes[i][name] = tuple(row.shape)
        arrays = {name: value.detach().cpu().numpy() for name, value in feats.items()}
        stats = [{} for _ in keys]
        for name, value in arrays.items():
            lengths = arrays.get(f"{name}_lengths")
            for i in range(len(keys)):
                # (frames, dim...) trimmed of padding; a value without lengths is one frame, as in ESPnet2
                stats[i][name] = value[i][:int(lengths[i])] if lengths is not None else value[i][None]
        return list(zip(shapes, stats))


def common_collate_fn(items, float_pad_value=0.0, int_pad_value=-32768):
    """``[(key, {name: array})] -> (keys, {name: padded tensor, name_lengths: int64 tensor})``: the
    semantics of ESPnet's ``CommonCollateFn`` (pad floats with 0.0, integers with -32768)."""
    import numpy as np
    import torch

    from snakeshard.io.batch import collate

    keys = [key for key, _ in items]
    names = list(items[0][1])
    for key, inputs in items:
        if set(inputs) != set(names):
            raise ContractError(f"item {key!r}: load_inputs gave {sorted(inputs)}, the batch's first key {sorted(names)}")
    batch = {}
    for name in names:
        arrays = [torch.from_numpy(np.asarray(inputs[name])) for _, inputs in items]
        pad = int_pad_value if arrays[0].dtype in (torch.int8, torch.int16, torch.int32, torch.int64) else float_pad_value
        padded = collate(arrays, keys, pad_value=pad)
        batch[name], batch[f"{name}_lengths"] = padded.data, padded.lengths
    return keys, batch


# -- the runner --

class CollectStatsProvider(InferenceProvider):
    """The dataset and a built-in frontend (``frontend: fbank`` or ``upstream``) from ``provider_config``.

    For the model path write your own provider whose env gives ``dataset``, ``model``, ``collate_fn``,
    ``device`` (and ``write_collected_feats`` if wanted), as ESPnet3's CollectStatsRunner expects.
    """

    config_keys = ("frontend", "feats_field", "write_collected_feats", "num_mel_bins", "frame_length", "frame_shift",
                   "dither", "snip_edges", "low_freq", "high_freq", "preemphasis_coefficient", "remove_dc_offset",
                   "window_type", "use_energy")  # the last ones: fbank's, for frontend: fbank

    def build_env(self) -> dict:
        from snakeshard.core.data import FEATS, STAGE_FORMAT, has_kaldi_features, load_dataset
        from snakeshard.stages.fbank import fbank_options

        options = {k: v for k, v in self.config.items() if k not in ("dataset", "devices")}
        frontend = options.pop("frontend", "fbank")
        write = options.pop("write_collected_feats", False)
        spec = self.config["dataset"]
        where = "stages.<stage>.provider_config"
        if frontend == "fbank":
            rate = int(spec.get("sample_rate") or 16000)
            spec = {**spec, "sample_rate": rate}
            built = FbankFrontend(fbank_options(options, rate))
        elif frontend == "upstream":
            field = options.pop("feats_field", "feats")
            if options:
                raise ConfigError(f"{where}.{sorted(options)[0]}: frontend 'upstream' takes only feats_field")
            if spec.get("format") != STAGE_FORMAT and not (field == FEATS and has_kaldi_features(spec)):
                raise ConfigError(f"{where}.frontend: 'upstream' reads features another stage wrote, or a Kaldi data "
                                  f"dir's feats.scp (feats_field: feats): dataset {spec.get('name')!r} must be a "
                                  "chained one ({from_stage: ..., dataset: ...}) or a data dir with a feats.scp")
            built = UpstreamFrontend(field)
        else:
            raise ConfigError(f"{where}.frontend: {frontend!r} is not a built-in frontend (fbank, upstream); for "
                              "a model with collect_feats, write a provider whose env gives model, collate_fn, device")
        return {"dataset": load_dataset(spec), "frontend": built, "write_collected_feats": bool(write)}


class CollectStatsRunner(BaseRunner):
    """Shapes per key (written as text fields), float64 sums per feature (the shard's state), merged exactly."""

    # A frontend's cost is linear in audio: shards of one hour of audio unless the stage says otherwise.
    default_sharding = {"shard_seconds": 3600}

    @staticmethod
    def forward(keys, *, dataset, frontend=None, model=None, collate_fn=None, device="cpu", load_inputs=None,
                collect_stats_kwargs=None):
        batch = keys if isinstance(keys, list) else [keys]
        if frontend is None:
            if model is None:
                raise ContractError("CollectStatsRunner needs env 'frontend' (CollectStatsProvider) or 'model' "
                                    "(an object with collect_feats(**batch)), with optional collate_fn and device")
            frontend = ModelFrontend(model, collate_fn, device, load_inputs, collect_stats_kwargs)
        results = [{"shapes": {name: ",".join(map(str, shape)) for name, shape in shapes.items()}, "stats": stats}
                   for shapes, stats in frontend(batch, dataset)]
        return results if isinstance(keys, list) else results[0]

    @staticmethod
    def init_state(**env):
        return {"batch_keys": None, "stats": {}}  # stats: name -> [count, sum, sum_square]

    @staticmethod
    def reduce_state(state, result, **env):
        import numpy as np

        key = result["key"]
        if state["batch_keys"] is None:
            state["batch_keys"] = list(result["shapes"])
        elif list(result["shapes"]) != state["batch_keys"]:
            raise DataError(f"item {key!r}: batch inputs {list(result['shapes'])}, earlier keys had {state['batch_keys']}")
        stats = state["stats"]
        if stats and list(result["stats"]) != list(stats):
            raise DataError(f"item {key!r}: the frontend returned {list(result['stats'])}, for earlier keys {list(stats)}")
        for name, seq in result["stats"].items():
            seq = np.asarray(seq, dtype=np.float64)
            total, square = seq.sum(0), (seq * seq).sum(0)
            if not (np.isfinite(total).all() and np.isfinite(square).all()):
                raise DataError(f"item {key!r}: feature {name!r} {_first_nonfinite(seq)}: refusing to add it to the "
                                "statistics (its mean and variance would be NaN)")
            if name not in stats:
                from snakeshard.stages.exact_sum import ExactSum  # numpy's: not imported by jobs that make no sums

                stats[name] = [0, ExactSum(total.shape), ExactSum(total.shape)]
            elif stats[name][1].shape != total.shape:
                raise DataError(f"item {key!r}: feature {name!r} has frames of shape {seq.shape[1:]}, earlier keys "
                                f"{stats[name][1].shape}")
            acc = stats[name]
            acc[0] += len(seq)
            acc[1].add(total)
            acc[2].add(square)
        return state

    @staticmethod
    def write_record(writers, result, state, *, write_collected_feats=False, **env) -> None:
        record = {"key": result["key"], **{f"{name}_shape": shape for name, shape in result["shapes"].items()}}
        if write_collected_feats:
            for name, seq in result["stats"].items():
                field = f"{COLLECTED}/{name}"
                writers.outputs.setdefault(field, {"format": "npy"})  # ESPnet2's NpyScpWriter; outputs: may differ
                record[field] = seq
        writers.write(record)

    @staticmethod
    def finalize_state(state, shard_dir, **env) -> list[str]:
        from snakeshard.io.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text

        names, exact = [], {}
        for name, (count, total, square) in state["stats"].items():
            atomic_write_bytes(Path(shard_dir) / f"{name}_stats.npz", stats_npz_bytes(count, total.value(), square.value()))
            names.append(f"{name}_stats.npz")
            exact[name] = {"count": count, "shape": list(total.shape), "sum": total.state(), "sum_square": square.state()}
        atomic_write_json(Path(shard_dir) / EXACT_SUMS, exact, fsync=False)
        atomic_write_text(Path(shard_dir) / BATCH_KEYS, _lines(state["batch_keys"] or []))
        atomic_write_text(Path(shard_dir) / STATS_KEYS, _lines(state["stats"]))
        return [*names, EXACT_SUMS, BATCH_KEYS, STATS_KEYS]

    @classmethod
    def merge(cls, shard_dirs: list[Path], output_dir: Path) -> list[str]:
        """Shape files and collected features: the default merge (plan order, checked). Statistics: the shards'
        exact sums added and rounded once; every shard must have the same batch and stats keys."""
        from snakeshard.core.merge import merge_fragments
        from snakeshard.io.atomic import atomic_write_bytes, atomic_write_text

        names = merge_fragments(shard_dirs, output_dir)
        keys = {}
        for what in (BATCH_KEYS, STATS_KEYS):
            first = (shard_dirs[0] / what).read_text(encoding="utf-8")
            for shard_dir in shard_dirs[1:]:
                if (shard_dir / what).read_text(encoding="utf-8") != first:
                    raise MergeError(f"{shard_dir}/{what} differs from {shard_dirs[0]}/{what}: all shards must "
                                     "see the same batch inputs and features")
            keys[what] = first.split()
        from snakeshard.stages.exact_sum import ExactSum

        parts = [json.loads((shard_dir / EXACT_SUMS).read_text()) for shard_dir in shard_dirs]
        for name in keys[STATS_KEYS]:
            count, shape = 0, tuple(parts[0][name]["shape"])
            total, square = ExactSum(shape), ExactSum(shape)
            for shard_dir, part in zip(shard_dirs, parts):
                if tuple(part[name]["shape"]) != shape:
                    raise MergeError(f"{shard_dir}/{EXACT_SUMS}: feature {name!r} has shape {part[name]['shape']}, "
                                     f"{shard_dirs[0]} has {list(shape)}")
                count += part[name]["count"]
                total.merge(ExactSum.from_state(part[name]["sum"], shape))
                square.merge(ExactSum.from_state(part[name]["sum_square"], shape))
            atomic_write_bytes(Path(output_dir) / f"{name}_stats.npz", stats_npz_bytes(count, total.value(), square.value()))
            names.append(f"{name}_stats.npz")
        for what in (BATCH_KEYS, STATS_KEYS):
            atomic_write_text(Path(output_dir) / what, _lines(keys[what]))
            names.append(what)
        return names


def _lines(names) -> str:
    return "".join(f"{name}\n" for name in names) or "\n"  # ESPnet2 writes a lone newline for none


def _first_nonfinite(seq) -> str:
    import numpy as np

    frame, *dims = np.argwhere(~np.isfinite(seq))[0]
    value = seq[(frame, *dims)]
    return f"holds {value} at frame {frame}" + (f", dim {tuple(int(d) for d in dims)}" if dims else "")


def stats_npz_bytes(count: int, total, square) -> bytes:
    """An ESPnet2 stats npz (count int64, sum and sum_square float64), byte for byte the same for the same
    numbers: np.savez stamps the current time into the zip, which would make reruns differ."""
    import numpy as np

    arrays = {"count": np.int64(count), "sum": np.asarray(total, dtype=np.float64),
              "sum_square": np.asarray(square, dtype=np.float64)}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w",
                              force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)
    return buf.getvalue()
