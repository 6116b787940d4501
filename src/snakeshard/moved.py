"""Where the flat modules of snakeshard 0.1 went when the package took its subpackages (core, io, stages,
workflow): importing an old path, from a user's code or a config's ``runner:``/``provider:``, fails naming the
new one, rather than with a bare "No module named".

Only names that no longer exist reach this finder: it is last on ``sys.meta_path``.
"""

MOVED = {
    "atomic": "io.atomic", "audio": "io.audio", "batch": "io.batch", "writers": "io.writers",
    "contract": "core.contract", "data": "core.data", "devices": "core.devices", "fingerprint": "core.fingerprint",
    "hooks": "core.hooks", "merge": "core.merge", "plan": "core.plan", "progress": "core.progress",
    "set_summary": "core.set_summary", "shard": "core.shard", "shard_files": "core.shard_files",
    "shard_pool": "core.shard_pool", "user_code": "core.user_code", "user_source": "core.user_source",
    "runners": "stages", "exact_sum": "stages.exact_sum", "wer": "stages.wer",
    "config_reference": "workflow.config_reference", "job": "workflow.job", "project": "workflow.project",
    "snakemake_patches": "workflow.snakemake_patches", "train_config": "workflow.train_config",
}

# What a user's code imported from a moved module that the public API now gives.
PUBLIC_NAMES = {"snakeshard.core.data": " (a provider's load_dataset: from snakeshard import load_dataset)"}


def new_path(name: str) -> str | None:
    """``name`` (``snakeshard.runners.fbank`` or a class path under it) at its new place; None if it did not move."""
    package, _, rest = name.partition(".")
    module, _, tail = rest.partition(".")
    if package != "snakeshard" or module not in MOVED:
        return None
    return ".".join(part for part in ("snakeshard", MOVED[module], tail) if part)


class MovedModules:
    """A finder (``sys.meta_path``) that turns the import of a moved module into an error naming its new path."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        new = new_path(fullname)
        if new is not None:
            public = PUBLIC_NAMES.get(new, "")
            raise ModuleNotFoundError(f"No module named {fullname!r}: it moved to {new!r}{public}", name=fullname)
        return None
