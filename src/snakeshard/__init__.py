"""snakeshard: sharded ML/speech jobs over large datasets, orchestrated by Snakemake.

Only light, stdlib-only modules are imported here: the Snakefile imports this
package at every parse (and on SLURM, in every job).
"""

from snakeshard.contract import BaseRunner, EnvironmentProvider, InferenceProvider
from snakeshard.errors import SnakeshardError
from snakeshard.version import __version__
from snakeshard.writers import Audio


def __getattr__(name: str):
    # Imported on use: its pathlib costs a one-key shard job 5 ms of its 29 ms CPU (bench/RESULTS.md section 16).
    if name == "snakefile":
        from snakeshard.resources import snakefile

        return snakefile
    raise AttributeError(f"module 'snakeshard' has no attribute {name!r}")


__all__ = ["Audio", "BaseRunner", "EnvironmentProvider", "InferenceProvider", "SnakeshardError", "__version__", "snakefile"]
