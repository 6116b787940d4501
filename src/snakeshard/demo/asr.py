"""The demo stage: PocketSphinx ASR over a Kaldi data dir, one hypothesis per utterance.

``provider_config`` options:
  decoder_options: dict   PocketSphinx config overrides (e.g. {beam: 1e-60})
  fail_on_keys: [key]     raise on these keys (to exercise failure handling and reruns)
  item_delay: seconds     sleep per item (to make a shard slow enough to kill mid-run in tests)
"""

from __future__ import annotations

import time

from snakeshard import BaseRunner, InferenceProvider
from snakeshard import load_dataset
from snakeshard.errors import ConfigError

MODEL_RATE = 16000


class PocketsphinxProvider(InferenceProvider):
    config_keys = ("decoder_options", "fail_on_keys", "item_delay")

    def build_env(self) -> dict:
        from snakeshard.demo.pocketsphinx_asr import make_decoder

        return {**self.build_parent_env(), "decoder": make_decoder(**self.config.get("decoder_options", {}))}

    def build_parent_env(self) -> dict:
        """With ``workers``, the shard job's own process runs no forward: everything but the decoder, whose
        load (~0.4 s) only the workers need."""
        spec = self.config["dataset"]
        if spec.get("sample_rate", MODEL_RATE) != MODEL_RATE:
            raise ConfigError(f"stages.<stage>.sample_rate is {spec['sample_rate']}; the PocketSphinx en-us model "
                              f"needs {MODEL_RATE} Hz audio")
        return {
            # load_audio refuses any other rate, naming key and file
            "dataset": load_dataset({**spec, "sample_rate": MODEL_RATE}),
            "decoder": None,
            "fail_on_keys": frozenset(self.config.get("fail_on_keys", [])),
            "item_delay": float(self.config.get("item_delay", 0)),
        }


class PocketsphinxRunner(BaseRunner):
    """Writes ``text`` (the hypothesis), merged into results/<stage>/<set>/text."""

    @staticmethod
    def forward(key, *, dataset, decoder, fail_on_keys, item_delay):
        from snakeshard.demo.pocketsphinx_asr import decode

        if key in fail_on_keys:
            raise RuntimeError(f"fail_on_keys asked to fail on {key!r}")
        if item_delay:
            time.sleep(item_delay)
        samples, _ = dataset.load_mono_audio(key, dtype="int16")
        return {"text": decode(decoder, samples)}
