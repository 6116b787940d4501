"""Voice activity detection with silero-vad (the TorchScript model inside its wheel), on padded batches.

Per key:
  speech        JSON Lines: the speech segments, ``[{"start": s, "end": e}, ...]`` in seconds
  speech_prob   ark/scp: float32 speech probability per 512-sample frame (32 ms at 16 kHz)
  wav           wav.scp + one wav per key: the audio from the first speech onset to the last offset
                (the whole recording when no speech is found: every key keeps its audio), so the
                merged output dir is a Kaldi data dir (``load_dataset`` reads it; a chained stage too)

Batches: ``collate`` pads the utterances of a batch to the longest; the model is causal, so trailing
padding leaves every utterance's own frames unchanged, and only those are kept (``unbatch``).
torch's batched kernels round differently from its single-item ones, so probabilities from
batches of different sizes differ in the last bits (about 1e-5 here); segments did not, in the
checks recorded in bench/RESULTS.md. Needs the ``torch`` extra (torch, silero-vad).

``provider_config``: threshold 0.5, min_speech_duration_ms 250, min_silence_duration_ms 100,
speech_pad_ms 30 (silero-vad's own defaults), plus ``threads`` (torch threads per job, default 1).
"""

from __future__ import annotations

from snakeshard import BaseRunner, InferenceProvider
from snakeshard.core.data import load_dataset
from snakeshard.errors import ConfigError
from snakeshard.io.writers import Audio

RATE = 16000
FRAME = 512  # samples per model step at 16 kHz
SEGMENT_OPTIONS = {"threshold": 0.5, "min_speech_duration_ms": 250, "min_silence_duration_ms": 100,
                   "speech_pad_ms": 30}


class SileroVadProvider(InferenceProvider):
    config_keys = ("threshold", "min_speech_duration_ms", "min_silence_duration_ms", "speech_pad_ms", "threads")

    @staticmethod
    def check_config(config: dict, where: str = "stages.<stage>.provider_config") -> None:
        """Each option a number in its range, refused at parse naming its key (a user trial: ``threshold: high``
        passed the parse, and the canary failed inside silero-vad's code with a TypeError)."""
        for key, value in config.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key == "threshold" and not (number and 0 < value < 1):
                raise ConfigError(f"{where}.threshold: a speech probability between 0 and 1 (default 0.5), "
                                  f"got {value!r}")
            if key.endswith("_ms") and not (number and value >= 0):
                raise ConfigError(f"{where}.{key}: milliseconds, a number >= 0 (default {SEGMENT_OPTIONS[key]}), "
                                  f"got {value!r}")
            if key == "threads" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"{where}.threads: torch threads per job, an integer >= 1 (default 1), got {value!r}")

    def build_env(self) -> dict:
        import torch
        from silero_vad import load_silero_vad

        options = {k: v for k, v in self.config.items() if k not in ("dataset", "devices", "threads")}
        self.check_config({k: v for k, v in self.config.items() if k not in ("dataset", "devices")})
        unknown = sorted(set(options) - set(SEGMENT_OPTIONS))
        if unknown:
            raise ConfigError(f"stages.<stage>.provider_config.{unknown[0]}: not a VAD option ({sorted(SEGMENT_OPTIONS)})")
        spec = self.config["dataset"]
        if spec.get("sample_rate", RATE) != RATE:
            raise ConfigError(f"stages.<stage>.sample_rate is {spec['sample_rate']}; this silero-vad stage runs at {RATE} Hz")
        model = load_silero_vad()  # sets torch's thread count to 1 when imported: set ours after it
        torch.set_num_threads(int(self.config.get("threads", 1)))
        device = (self.config.get("devices") or ["cpu"])[0]
        return {"dataset": load_dataset({**spec, "sample_rate": RATE}), "model": model.to(device),
                "device": device, "segment_options": {**SEGMENT_OPTIONS, **options}}


def speech_probabilities(model, waveforms: list, device: str = "cpu") -> list:
    """Per waveform (1-D float32 numpy), its per-frame speech probabilities, from one padded batch."""
    import torch

    from snakeshard.io.batch import collate, unbatch

    batch = collate([torch.from_numpy(w) for w in waveforms])
    with torch.no_grad():
        probs = model.audio_forward(batch.data.to(device), RATE)  # (B, ceil(T_max / 512)), resets its state
    frames = (batch.lengths + FRAME - 1) // FRAME
    return [p.cpu().numpy() for p in unbatch(probs, frames)]


class SileroVadRunner(BaseRunner):
    @staticmethod
    def forward(keys, *, dataset, model, device, segment_options):
        from silero_vad import get_speech_timestamps_from_probs

        batch = keys if isinstance(keys, list) else [keys]
        waveforms = [dataset.load_mono_audio(key, dtype="float32")[0] for key in batch]
        results = []
        for wave, probs in zip(waveforms, speech_probabilities(model, waveforms, device)):
            segments = get_speech_timestamps_from_probs(probs.tolist(), sampling_rate=RATE,
                                                        audio_length_samples=len(wave), **segment_options)
            start, end = (segments[0]["start"], segments[-1]["end"]) if segments else (0, len(wave))
            results.append({
                "speech": [{"start": round(s["start"] / RATE, 3), "end": round(s["end"] / RATE, 3)} for s in segments],
                "speech_prob": probs,
                "wav": Audio(wave[start:end], RATE),
            })
        return results if isinstance(keys, list) else results[0]
