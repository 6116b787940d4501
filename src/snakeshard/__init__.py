"""snakeshard: sharded ML/speech jobs over large datasets, orchestrated by Snakemake.

Only light, stdlib-only modules are imported here: the Snakefile imports this
package at every parse (and on SLURM, in every job).
"""

__version__ = "0.1.0"

from snakeshard.contract import BaseRunner, EnvironmentProvider, InferenceProvider  # noqa: E402
from snakeshard.errors import SnakeshardError  # noqa: E402
from snakeshard.writers import Audio  # noqa: E402


def __getattr__(name: str):
    # Imported on use: its pathlib costs a one-key shard job 5 ms of its 29 ms CPU (bench/RESULTS.md section 16).
    if name == "snakefile":
        from snakeshard.resources import snakefile

        return snakefile
    raise AttributeError(f"module 'snakeshard' has no attribute {name!r}")


__all__ = ["Audio", "BaseRunner", "EnvironmentProvider", "InferenceProvider", "SnakeshardError", "__version__", "snakefile"]
