"""Kaldi filterbank features with kaldi-native-fbank, written as a Kaldi feature dir.

Per key: ``feats`` (float32 frames x num_mel_bins, Kaldi ark/scp) and ``utt2num_frames`` (text), so
the merged ``results/<stage>/<set>/`` holds ``feats.scp`` and ``utt2num_frames`` as Kaldi's
``make_fbank.sh`` leaves them. Samples are scaled as Kaldi reads them (16-bit integer range), so the
numbers match ``compute-fbank-feats``.

``provider_config`` (Kaldi's option names; defaults as Kaldi's except dither):
  num_mel_bins: 80   frame_length: 25 (ms)   frame_shift: 10 (ms)   dither: 0.0 (deterministic)
  snip_edges: true   low_freq: 20   high_freq: 0 (0: Nyquist; negative: offset from it)
  preemphasis_coefficient: 0.97   remove_dc_offset: true   window_type: povey   use_energy: false
plus ``global_mvn: true`` (see FbankProvider).
"""

from __future__ import annotations

from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard.core.data import load_dataset
from snakeshard.errors import ConfigError, DataError

DEFAULTS = {"num_mel_bins": 80, "frame_length": 25.0, "frame_shift": 10.0, "dither": 0.0, "snip_edges": True,
            "low_freq": 20.0, "high_freq": 0.0, "preemphasis_coefficient": 0.97, "remove_dc_offset": True,
            "window_type": "povey", "use_energy": False}


def fbank_options(config: dict, sample_rate: int):
    """kaldi_native_fbank.FbankOptions from Kaldi-named options (unknown names are an error)."""
    import kaldi_native_fbank as knf

    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"stages.<stage>.provider_config.{unknown[0]}: not a fbank option ({sorted(DEFAULTS)})")
    c = {**DEFAULTS, **config}
    opts = knf.FbankOptions()
    frame = opts.frame_opts
    frame.samp_freq = float(sample_rate)
    frame.frame_length_ms = float(c["frame_length"])
    frame.frame_shift_ms = float(c["frame_shift"])
    frame.dither = float(c["dither"])
    frame.snip_edges = bool(c["snip_edges"])
    frame.preemph_coeff = float(c["preemphasis_coefficient"])
    frame.remove_dc_offset = bool(c["remove_dc_offset"])
    frame.window_type = str(c["window_type"])
    opts.mel_opts.num_bins = int(c["num_mel_bins"])
    opts.mel_opts.low_freq = float(c["low_freq"])
    opts.mel_opts.high_freq = float(c["high_freq"])
    opts.use_energy = bool(c["use_energy"])
    return opts


def compute_fbank(samples, opts):
    """(frames, num_mel_bins) float32 fbank of 1-D samples in the 16-bit integer range."""
    import kaldi_native_fbank as knf
    import numpy as np

    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(opts.frame_opts.samp_freq, samples)
    fbank.input_finished()
    n = fbank.num_frames_ready
    out = np.empty((n, opts.mel_opts.num_bins + int(opts.use_energy)), dtype=np.float32)
    for i in range(n):
        out[i] = fbank.get_frame(i)
    return out


def fbank_of(dataset, key: str, opts):
    """(samples read, fbank) of one key of ``dataset``: its audio read as Kaldi reads wavs (int16 scale).

    A recording shorter than one frame has no frames: refused naming the key (Kaldi's compute-fbank-feats
    skips it with a warning; here every key's result holds every field, and an empty matrix would pass
    into training and statistics unnoticed)."""
    samples, rate = dataset.load_mono_audio(key, dtype="int16")
    feats = compute_fbank(samples.astype("float32"), opts)
    if not len(feats):
        frame = opts.frame_opts.frame_length_ms
        raise DataError(f"key {key!r}: {len(samples)} samples ({1000 * len(samples) / rate:.1f} ms) are shorter than "
                        f"one {frame:g} ms frame: no fbank frames; leave it out of the dataset")
    return samples, feats


class FbankProvider(EnvironmentProvider):
    """The dataset (at the stage's ``sample_rate``, default 16000) and the fbank options.

    ``global_mvn: true``: normalize the features with the statistics of a collect-stats stage (ESPnet2's
    GlobalMVN); the stage's dataset is then that stage's output, ``{from_stage: stats, dataset: train}``,
    so its jobs wait for those statistics and rerun when they change.
    """

    reads_upstream_merge = ("global_mvn",)
    config_keys = ("num_mel_bins", "frame_length", "frame_shift", "dither", "snip_edges", "low_freq", "high_freq",
                   "preemphasis_coefficient", "remove_dc_offset", "window_type", "use_energy", "global_mvn")

    def build_env_local(self) -> dict:
        spec = self.config["dataset"]
        rate = int(spec.get("sample_rate") or 16000)
        options = {k: v for k, v in self.config.items() if k not in ("dataset", "devices", "global_mvn")}
        opts = fbank_options(options, rate)
        dataset = load_dataset({**spec, "sample_rate": rate})
        env = {"dataset": dataset, "fbank_opts": opts}
        if self.config.get("global_mvn"):
            env["mvn"] = _global_mvn(dataset, opts.mel_opts.num_bins + int(opts.use_energy))
        return env


def _global_mvn(dataset, dims: int):
    from snakeshard.stages.global_mvn import GlobalMVN

    stats = getattr(dataset, "set_dir", None)
    if stats is None or not (stats / "feats_stats.npz").exists():
        raise ConfigError(f"stages.<stage>.provider_config.global_mvn: dataset {dataset.spec.get('name')!r} must be "
                          "a collect-stats stage's output ({from_stage: <stats stage>, dataset: ...}): no "
                          f"feats_stats.npz in {stats or 'its data dir'}")
    mvn = GlobalMVN(stats)
    if mvn.mean.shape != (dims,):
        raise ConfigError(f"stages.<stage>.provider_config.global_mvn: {stats}/feats_stats.npz has {mvn.mean.shape} "
                          f"dims, this stage's fbank {dims}: compute both with the same options")
    return mvn


class FbankRunner(BaseRunner):
    """One key or a batch of keys (fbank is per utterance; batches only group the calls)."""

    @staticmethod
    def forward(keys, *, dataset, fbank_opts, mvn=None):
        batch = keys if isinstance(keys, list) else [keys]
        results = []
        for key in batch:
            _, feats = fbank_of(dataset, key, fbank_opts)
            if mvn is not None:
                feats = mvn(feats)
            results.append({"feats": feats, "utt2num_frames": len(feats)})
        return results if isinstance(keys, list) else results[0]
