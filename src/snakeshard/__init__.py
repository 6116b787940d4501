"""snakeshard: sharded ML/speech jobs over large datasets, orchestrated by Snakemake.

Only light, stdlib-only modules are imported here: the Snakefile imports this
package at every parse (and on SLURM, in every job).
"""

import sys

from snakeshard.core.contract import BaseRunner, EnvironmentProvider, InferenceProvider
from snakeshard.errors import SnakeshardError
from snakeshard.io.writers import Audio
from snakeshard.moved import MovedModules
from snakeshard.version import __version__

if MovedModules not in sys.meta_path:
    sys.meta_path.append(MovedModules)  # last: it sees only names no other finder has


def __getattr__(name: str):
    # Imported on use: its pathlib costs a one-key shard job 5 ms of its 29 ms CPU (bench/RESULTS.md section 16).
    if name == "snakefile":
        from snakeshard.resources import snakefile

        return snakefile
    if name == "check_config_file":  # the project Snakefile's first call: PyYAML on use
        from snakeshard.io.yaml_file import check_config_file

        return check_config_file
    if name in ("collate", "unbatch"):  # padded batches for a runner's own forward (docs/outputs.md): numpy on use
        from snakeshard.io import batch

        return getattr(batch, name)
    if name == "require_current":  # for a user's own reader of merged output (docs/guide.md)
        from snakeshard.core.merge import require_current

        return require_current
    if name == "load_dataset":  # the datasets' readers (json, numpy on use): a provider's, not every job's
        from snakeshard.core.data import load_dataset

        return load_dataset
    raise AttributeError(f"module 'snakeshard' has no attribute {name!r}")


__all__ = ["Audio", "BaseRunner", "EnvironmentProvider", "InferenceProvider", "SnakeshardError", "__version__",
           "check_config_file", "collate", "load_dataset", "require_current", "snakefile", "unbatch"]
