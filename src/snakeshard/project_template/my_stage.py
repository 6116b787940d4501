# my_stage.py
import numpy as np

from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard import load_dataset


class EnergyProvider(EnvironmentProvider):
    """Builds the env once per shard job: here the dataset and a config value."""

    def build_env_local(self):
        return {"dataset": load_dataset(self.config["dataset"]), "floor_db": self.config.get("floor_db", -80.0)}


class EnergyRunner(BaseRunner):
    """Writes two Kaldi-style per-key files: `duration` and `energy_db`."""

    @staticmethod
    def forward(key, *, dataset, floor_db):  # env entries are injected by parameter name
        samples, rate = dataset.load_audio(key)
        rms = float(np.sqrt(np.mean(samples**2)))
        energy_db = max(20 * np.log10(rms + 1e-12), floor_db)
        return {"duration": f"{len(samples) / rate:.3f}", "energy_db": f"{energy_db:.2f}"}
