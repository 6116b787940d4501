"""An inference stage from a training stage (``from_stage: <training stage>``): the shard jobs run the runner's
``infer_step`` as their ``forward``, over the trained ``model.pt``, loaded once per job.

``infer_step(batch, *, model, dataset, ...)`` gets a list of keys and returns ``{key: {field: value}}``; its
fields are written and merged as any stage's. ``model`` is the provider's model with model.pt's weights, in eval
mode, called under ``torch.inference_mode``; ``dataset`` is the shard's dataset; ``normalize`` the training
stage's GlobalMVN when it had ``stats:``.
"""

from __future__ import annotations

import functools

from snakeshard.core.contract import BaseRunner
from snakeshard.core.hooks import class_attribute, runner_name
from snakeshard.errors import ContractError, DataError
from snakeshard.train.checkpoint import UNREADABLE, read_checkpoint


def model_runner(runner_cls: type, stage: str) -> type:
    """A BaseRunner whose forward is ``runner_cls.infer_step`` (one key or a batch in, its results out)."""
    from snakeshard.train.runner import defines

    name = runner_name(runner_cls)
    if not defines(runner_cls, "infer_step"):
        raise ContractError(f"stages.{stage}.runner: {name} defines no infer_step, which an inference stage from a "
                            "training stage runs as its forward: define @staticmethod infer_step(batch, *, model, ...) "
                            "returning {key: {field: value}}")
    if not isinstance(class_attribute(runner_cls, "infer_step"), staticmethod):
        raise ContractError(f"stages.{stage}.runner: {name}.infer_step must be a @staticmethod (an inference stage "
                            "from a training stage runs it as its forward)")
    infer = runner_cls.infer_step

    @functools.wraps(infer)  # injection reads infer_step's parameters (through __wrapped__)
    def forward(batch, **env):
        import torch

        keys = batch if isinstance(batch, list) else [batch]
        with torch.inference_mode():
            out = infer(keys, **env)
        if not isinstance(out, dict):
            raise ContractError(f"{name}.infer_step returned a {type(out).__name__}: it returns {{key: {{field: "
                                "value}}}} for the batch's keys")
        missing = [k for k in keys if k not in out]
        if missing:
            raise ContractError(f"{name}.infer_step returned no result for key {missing[0]!r} (of {len(keys)} "
                                "keys in the batch)")
        results = [out[k] for k in keys]
        return results if isinstance(batch, list) else results[0]

    return type(runner_cls.__name__, (BaseRunner,), {"forward": staticmethod(forward),
                                                     "__module__": runner_cls.__module__,
                                                     "__qualname__": runner_cls.__qualname__})


def with_trained_model(env: dict, spec: dict) -> dict:
    """``env`` with the trained weights in its ``model`` (eval mode), the shard's ``dataset`` and ``normalize``.
    The model must be the one the current training config and data make: a stale model.pt is refused."""
    import json
    from pathlib import Path

    from snakeshard.core.data import load_dataset
    from snakeshard.train.numerics import settle_vector_math

    settle_vector_math()  # a shard rerun after a kill must infer what the first run did (numerics.py)
    model_ref, where = spec["model"], f"stages.{spec['stage']}"
    if "model" not in env:
        raise ContractError(f"{where}.provider: {spec['provider']} built no 'model' (it gave {sorted(env)})")
    done = Path(model_ref["done"])
    try:
        fingerprint = json.loads(done.read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        fingerprint = None
    if fingerprint != model_ref["fingerprint"]:
        raise DataError(f"{where}.from_stage: {model_ref['path']} is not the model the current config and data of "
                        f"stage {model_ref['stage']!r} train ({done} {'says another' if fingerprint else 'is missing'});"
                        " run snakemake, which trains it first")
    try:
        checkpoint = read_checkpoint(model_ref["path"])
    except UNREADABLE as e:  # written atomically, so a disk fault or a hand edit
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        raise DataError(f"{where}.from_stage: {model_ref['path']} does not read ({why}); delete {done} and run "
                        "snakemake, which trains it again") from e
    try:
        env["model"].load_state_dict(checkpoint["model"])
    except RuntimeError as e:  # torch lists each mismatched tensor, a line each
        raise ContractError(f"{where}: {model_ref['path']} (trained by stage {model_ref['stage']!r}) does not fit the "
                            f"model {spec['provider']} builds here ({' '.join(str(e).split())}); this stage builds it "
                            f"with stage {model_ref['stage']!r}'s provider_config, its own provider_config keys "
                            "laid over them") from e
    env["model"].eval()
    env["dataset"] = load_dataset(spec["dataset"])
    if model_ref["stats"]:
        from snakeshard.train.stage import global_mvn

        env["normalize"] = global_mvn(model_ref["stats"])
    return env
