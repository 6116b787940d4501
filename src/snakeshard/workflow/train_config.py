"""Training stages in the config, as the workflow reads them at parse time (nothing heavy is imported here).

A stage with ``train:`` trains: one job over every key of its ``train`` dataset (and ``valid``), with the
training keys below. Its datasets are planned as any stage's (one shard each), so their keys, records, audio and
upstream merges get fingerprints the usual way; ``Workflow`` adds the training fingerprint over them.
A stage with ``from_stage: <training stage>`` infers with that stage's model: its shards run the runner's
``infer_step`` over ``model.pt`` (see train/inference.py), with that stage's runner, provider and provider_config
unless it sets its own (its provider_config keys are laid over the training stage's).
"""

from __future__ import annotations

from snakeshard.core.devices import requested_gpus
from snakeshard.errors import ConfigError

# The keys train() reads (loop.DEFAULTS), taken from the stage config as they are.
LOOP_KEYS = ("seed", "epochs", "max_steps", "batch_size", "accum_steps", "clip_grad_norm", "skip_nonfinite",
             "schedule", "score", "checkpoint")
TRAINING_ONLY = ("train", "valid", "stats", "labels", "epochs", "max_steps", "seed", "accum_steps", "clip_grad_norm",
                 "skip_nonfinite", "schedule", "checkpoint", "score", "ranks")
# Keys of a shard stage that mean nothing to a job that trains on every key at once.
SHARD_ONLY = ("datasets", "sharding", "shards_per_job", "canary", "workers", "devices", "worker_order", "item_timeout",
              "worker_init_timeout", "outputs", "allow_nonfinite")
POOL_KEYS = ("workers", "devices", "worker_order", "item_timeout", "worker_init_timeout")


def is_training(stage: dict) -> bool:
    return "train" in stage


def training_stages(config: dict) -> list[str]:
    return [name for name, stage in config["stages"].items() if is_training(stage)]


def model_source(config: dict, stage: str) -> str | None:
    """The training stage whose model ``stage`` infers with (its ``from_stage``), or None."""
    return config["stages"][stage].get("from_stage")


def check_stage_kind(name: str, stage: dict, datasets: dict, stages: dict) -> None:
    """A training stage's, or an inference-from-training stage's, own keys; fills in what the rest of the
    workflow reads of every stage (``datasets``, ``sharding``, and for ``from_stage``: runner and provider)."""
    where = f"stages.{name}"
    if is_training(stage):
        _check_training(where, stage, datasets, stages)
        return
    misplaced = [key for key in TRAINING_ONLY if key in stage]
    if misplaced:
        raise ConfigError(f"{where}.{misplaced[0]}: only for a training stage (one with train: <dataset>)")
    if "from_stage" in stage:
        source = stage["from_stage"]
        if source not in stages or not is_training(stages[source]):
            trained = sorted(n for n, s in stages.items() if is_training(s))
            raise ConfigError(f"{where}.from_stage: {source!r} is not a training stage (training stages: "
                              f"{trained or 'none'}); a chained dataset takes from_stage under datasets")
        pooled = [key for key in POOL_KEYS if key in stage]
        if pooled:
            raise ConfigError(f"{where}.{pooled[0]}: an inference stage from a trained model runs in the shard job's "
                              "own process (no pool); leave it out")
        for role in ("runner", "provider"):
            stage.setdefault(role, stages[source][role])
        _check_infer_step(where, stage["runner"])
        if stage["provider"] == stages[source]["provider"]:  # the model is built as it was trained; own keys win
            stage["provider_config"] = {**(stages[source].get("provider_config") or {}),
                                        **(stage.get("provider_config") or {})}


def model_config_keys(config: dict, stage: str) -> list[str]:
    """The keys of an inference stage's provider_config that are its training stage's: same provider, and the value
    the training stage has (check_stage_kind lays the inference stage's own keys over the training stage's). They
    build the model as it was trained, and the trained model's fingerprint covers them; [] for another stage."""
    source = model_source(config, stage)
    if not source:
        return []
    own, trained = config["stages"][stage], config["stages"][source]
    if own["provider"] != trained["provider"]:
        return []
    inherited = trained.get("provider_config") or {}
    mine = own.get("provider_config") or {}
    return sorted(k for k, v in inherited.items() if k in mine and mine[k] == v)


def _check_infer_step(where: str, runner: str) -> None:
    """An inference stage's runner defines ``infer_step`` (what its shard jobs run): read from the runner's source,
    so that `snakemake -n` says so rather than the canary after the whole training."""
    from snakeshard.core.user_source import defines_method

    if defines_method(runner, "infer_step", f"{where}.runner") is False:
        raise ConfigError(f"{where}.runner: {runner} defines no infer_step, which an inference stage from a training "
                          "stage runs as its forward: define @staticmethod infer_step(batch, *, model, ...) returning "
                          "{key: {field: value}}, or give this stage its own runner: (a subclass of the training "
                          "stage's, in a module of its own) that does")


def _check_training(where: str, stage: dict, datasets: dict, stages: dict) -> None:
    wrong = [key for key in SHARD_ONLY if key in stage]
    if wrong:
        raise ConfigError(f"{where}.{wrong[0]}: not for a training stage, which trains in one job over every key of "
                          f"its train dataset; name the data with train: and valid:")
    if "from_stage" in stage:
        raise ConfigError(f"{where}.from_stage: a training stage takes its data from train: and valid: datasets")
    for role in ("train", "valid"):
        if role in stage and stage[role] not in datasets:
            raise ConfigError(f"{where}.{role}: {stage[role]!r} is not defined under datasets ({sorted(datasets)})")
    if stage.get("valid") == stage["train"]:
        raise ConfigError(f"{where}.valid: the same dataset as train ({stage['train']!r}); give a held-out one")
    if "epochs" in stage and "max_steps" in stage:
        raise ConfigError(f"{where}: set epochs or max_steps, not both")
    score = stage.get("score")  # (sort_by_length without batches: validate_config checks it for every stage)
    if score and score.get("split", "valid") == "valid" and "valid" not in stage:
        raise ConfigError(f"{where}.score.split: 'valid' (the default) needs a valid: dataset; set one, or "
                          "split: train")
    _check_ranks(where, stage)
    if "schedule" in stage:
        from snakeshard.train.schedule import check_options

        check_options(stage["schedule"], f"{where}.schedule")
    stats = stage.get("stats")
    if stats:
        source = stages.get(stats["from_stage"])
        if source is None:
            raise ConfigError(f"{where}.stats.from_stage: {stats['from_stage']!r} is not a stage ({sorted(stages)})")
        if stats["dataset"] not in source.get("datasets", ()):
            raise ConfigError(f"{where}.stats.dataset: stage {stats['from_stage']!r} runs over "
                              f"{source.get('datasets')}, not {stats['dataset']!r}")
        _check_stats_runner(where, stats["from_stage"], source)
    stage["datasets"] = [stage["train"]] + ([stage["valid"]] if "valid" in stage else [])
    stage["sharding"] = {"num_shards": 1}


def _check_stats_runner(where: str, name: str, source: dict) -> None:
    """``stats.from_stage`` is a collect-stats stage: its merged output is where feats_stats.npz is read from (another
    stage's would fail only in the training job, after every stage before it ran)."""
    from snakeshard.core.user_source import COLLECT_STATS_RUNNER, is_collect_stats_runner

    runner = source.get("runner")
    if is_training(source) or not runner or not is_collect_stats_runner(runner, f"stages.{name}.runner"):
        wanted = COLLECT_STATS_RUNNER.replace(".collect_stats", "")  # as configs name it
        raise ConfigError(f"{where}.stats.from_stage: stage {name!r} (runner {runner or 'none'}) is not a "
                          f"collect-stats stage: stats: names a stage whose runner is {wanted} (or a subclass of "
                          "it), whose merged output holds feats_stats.npz")


def _check_ranks(where: str, stage: dict) -> None:
    """``ranks``: an int >= 1; with GPUs (resources gpu or gres), their number (one rank per GPU)."""
    if "ranks" not in stage:
        return
    ranks = stage["ranks"]
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"{where}.ranks: {ranks!r} is not a number of ranks (an integer >= 1)")
    gpus = requested_gpus(stage.get("resources") or {})
    if gpus and ranks != gpus:
        raise ConfigError(f"{where}.ranks: {ranks}, and {where}.resources asks for {gpus} GPU(s): one rank runs on "
                          f"each GPU, so set ranks: {gpus} or leave it out")


def ranks(stage: dict) -> int:
    """How many processes train a training stage: ``ranks``, else its GPUs when more than one, else 1."""
    gpus = requested_gpus(stage.get("resources") or {})
    return int(stage.get("ranks") or (gpus if gpus > 1 else 1))


def loop_config(stage: dict) -> dict:
    """The training loop's config (loop.DEFAULTS' keys) from a training stage's config. ``ranks`` only when more
    than one: it changes the result (the fingerprint), and ranks: 1 is the same run as none."""
    loop = {key: stage[key] for key in LOOP_KEYS if key in stage}
    n = ranks(stage)
    return {**loop, "ranks": n} if n > 1 else loop
