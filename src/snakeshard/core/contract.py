"""The user contract: providers build the environment, runners process items.

Kept compatible in spirit with ESPnet3's parallel runner:

* ``EnvironmentProvider(config)`` builds ``env`` (a dict: dataset, model, ...)
  with ``build_env_local()`` for in-process runs and ``build_worker_setup_fn()``
  for shard jobs, which calls the returned function once per job.
* ``BaseRunner.forward`` is a ``@staticmethod`` whose first parameter receives a
  key (or a list of keys when ``batch_size`` is set) and whose other parameters
  are filled from ``env`` by name; ``**env`` receives everything.
* Hooks shape one shard's life: ``init_state, open_writers -> (forward -> reduce_state
  -> write_record)* -> close_writers -> finalize_state -> done`` (``write_record`` gets the
  state after that item's ``reduce_state``); ``merge`` runs once in the merge rule.
"""

from __future__ import annotations

from snakeshard.core.hooks import overrides
from snakeshard.errors import ContractError
from snakeshard.io.writers import FieldWriters

# Names used only in annotations: importing them costs a shard job ~8 ms before its first item
# (pathlib 5 ms, bench/RESULTS.md section 16; typing 3 ms). Type checkers read TYPE_CHECKING = False as typing's.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

class EnvironmentProvider:
    """Builds what ``forward`` needs. Subclass and implement ``build_env_local``.

    ``config`` is the stage's ``provider_config`` from config.yaml, plus
    ``config["dataset"]``: the spec of the dataset being processed (pass it to
    ``snakeshard.load_dataset``), and in shard jobs ``config["devices"]``:
    ``["cpu"]``, or ``["cuda:0", ...]`` for the GPUs of the job's own allocation.
    """

    # provider_config options that, set true, make the provider read its chained dataset's whole merged output,
    # not only the upstream shards over the shard's own keys (fbank's global_mvn: statistics summed over every
    # key). The stage's shard jobs then wait for the upstream merge and rerun when it changes. A literal in the
    # class's own body: the workflow reads it from the source at parse time, without importing the provider.
    reads_upstream_merge: tuple[str, ...] = ()

    # The provider_config keys this provider takes, as a literal in the class's own body (read at parse time, as
    # reads_upstream_merge): the parse then refuses any other key, naming every one and the key it is close to,
    # before a job starts. None: any key is passed on (a misspelt one then shows only in what the provider does).
    config_keys: tuple[str, ...] | None = None

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})

    def build_env_local(self) -> dict:
        """The env of an in-process run (``runner(keys)``). Default: ``build_worker_setup_fn()()``, when a
        subclass overrides only that (ESPnet3's worker-setup style): in-process and shard jobs then build
        the env alike."""
        if overrides(type(self), "build_worker_setup_fn"):
            return self.build_worker_setup_fn()()
        raise NotImplementedError(f"{type(self).__name__} must implement build_env_local() "
                                  "(or build_worker_setup_fn())")

    def build_worker_setup_fn(self) -> Callable[[], dict]:
        """A picklable-in-spirit function a worker calls once to build its env (default: build_env_local)."""
        return self.build_env_local

    def build_parent_env(self) -> dict:
        """With ``workers``/``devices`` (forward in pool workers), the env of the shard job's own process,
        where the writer and state hooks run (and ``item_length``). Default: ``build_env_local()``; override
        it to leave out what only ``forward`` needs (the model), if loading that once more is costly."""
        return self.build_env_local()


class InferenceProvider(EnvironmentProvider):
    """A provider whose local env is built once and then reused (models are expensive to load).

    Implement ``build_env()``, or, as in ESPnet3, ``build_worker_setup_fn()`` returning the function that
    builds the env. In-process runs and shard jobs both build it with ``build_worker_setup_fn()()`` (whose
    default is ``build_env``); in-process, that happens once per provider (ESPnet3 builds it in
    ``__init__``; here on the first ``build_env_local()``).
    """

    _env: dict | None = None

    def build_env_local(self) -> dict:
        if self._env is None:
            self._env = self.build_worker_setup_fn()()
        return self._env

    def build_worker_setup_fn(self) -> Callable[[], dict]:
        return self.build_env

    def build_env(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must implement build_env() (or build_worker_setup_fn())")


class BaseRunner:
    """Subclass, set ``forward`` as a ``@staticmethod``; optionally override the hooks.

    ``MyRunner(provider, output_dir=...)(keys)`` runs the same code path as one
    shard job, in-process (for notebooks and tests). Without ``output_dir`` it
    returns the list of results instead of writing files.
    """

    # Batching: None -> forward gets one key; batch_size N -> lists of up to N keys; batch_seconds S ->
    # lists of up to S seconds of audio (item_length), at most batch_size keys if both are set.
    # sort_by_length groups keys of similar length (outputs are still written in plan order).
    batch_size: int | None = None
    batch_seconds: float | None = None
    sort_by_length: bool = False
    # Without output_dir, the in-process call returns results and runs no writer hooks
    # and no finalize_state (there is no shard dir to write into).

    def __init__(self, provider: EnvironmentProvider, *, output_dir=None, batch_size: int | None = None,
                 batch_seconds: float | None = None, sort_by_length: bool | None = None,
                 outputs: dict | None = None, progress: bool = False):
        cls = type(self)
        self.provider = provider
        self.output_dir = output_dir
        self.batching = {
            "batch_size": batch_size if batch_size is not None else cls.batch_size,
            "batch_seconds": batch_seconds if batch_seconds is not None else cls.batch_seconds,
            "sort_by_length": sort_by_length if sort_by_length is not None else cls.sort_by_length,
        }
        self.outputs = outputs or {}
        self.progress = progress

    def __call__(self, keys: list[str]):
        """Run over ``keys`` (strings; ints, as ESPnet3's ``runner(range(n))`` passes, are positions into the
        env's ``dataset``: see ``resolve_keys``)."""
        from snakeshard.core.shard import run_shard

        env = self.provider.build_env_local()
        return run_shard(type(self), env, resolve_keys(keys, env), self.output_dir, progress=self.progress,
                         outputs=self.outputs, **self.batching)

    @staticmethod
    def forward(idx_or_batch, **env):
        raise NotImplementedError("a runner must define @staticmethod forward(key_or_batch, *, ...env names)")

    # -- state hooks: per-shard accumulators (statistics, metric sums) --
    @staticmethod
    def init_state(**env):
        return None

    @staticmethod
    def reduce_state(state, result, **env):
        return state

    @staticmethod
    def finalize_state(state, shard_dir, **env) -> list[str] | None:
        """Write the shard's accumulated state (statistics, metric sums) into ``shard_dir``; return the
        names of the files written. The shard loop fsyncs them and records their size and CRC-32 in
        ``done["state_files"]``; the merge refuses a shard whose state files changed or went missing,
        then ``merge`` reads them (plain ``open``/``np.load``) and combines them in plan order."""

    @staticmethod
    def item_length(key, **env) -> float:
        """A key's length for ``batch_seconds`` and ``sort_by_length``: by default its audio seconds
        from ``env["dataset"]`` (``duration(key)``: the dataset's durations, else the audio header)."""
        dataset = env.get("dataset")
        if not hasattr(dataset, "duration"):
            raise ContractError("batch_seconds and sort_by_length need each key's length: give the env a "
                                "'dataset' from snakeshard.load_dataset, or override item_length(key, **env)")
        return dataset.duration(key)

    # -- writer hooks --
    @staticmethod
    def open_writers(shard_dir, **env):
        return FieldWriters(shard_dir)

    @staticmethod
    def write_record(writers, result, state, **env) -> None:
        writers.write(result)

    @staticmethod
    def close_writers(writers, state, **env) -> list[str]:
        """Close writers; return the names of the per-key index files the merge concatenates
        (``key value`` text, ``key path`` scp, ``{"key": ...}`` JSON Lines: one line per key)."""
        return writers.close()

    @classmethod
    def merge(cls, shard_dirs: list[Path], output_dir: Path) -> list[str]:
        """Combine shard outputs in ``output_dir``; default: validated concat of per-key fragments."""
        from snakeshard.core.merge import merge_fragments

        return merge_fragments(shard_dirs, output_dir)

    # PNG files drawn from the merged output by the workflow's report rule (registered for
    # `snakemake --report`), a literal tuple read at parse time, e.g. ScoringRunner's ("metrics.png",).
    reports: tuple = ()

    @classmethod
    def report(cls, set_dir: Path, name: str, path: Path) -> None:
        """Draw the report file ``name`` (one of ``reports``) of the merged ``set_dir`` into ``path``."""
        raise NotImplementedError(f"{cls.__name__} lists {name!r} in reports but does not define report()")


def resolve_keys(keys, env: dict) -> list[str]:
    """The keys of an in-process call as strings. An int is a position into ``env["dataset"]`` when that is a
    ``snakeshard.load_dataset`` dataset, whose keys keep the dataset's file order (the plan's): ``range(2)`` is
    its first two keys, as ESPnet3's int indices. Any other int is refused, naming it."""
    keys = list(keys)
    if all(isinstance(k, str) for k in keys):
        return keys
    order = getattr(env.get("dataset"), "keys", None)
    resolved = []
    for k in keys:
        if isinstance(k, str):
            resolved.append(k)
            continue
        if isinstance(k, bool) or not hasattr(k, "__index__"):
            raise ContractError(f"runner(keys): {k!r} is a {type(k).__name__}; keys are strings (the dataset's "
                                "keys, in order: list(dataset)), or ints as positions into the env's dataset")
        if not isinstance(order, list):
            raise ContractError(f"runner(keys): {k!r} is an int; keys are strings (list(dataset) gives a dataset's "
                                "keys in order). An int is taken as a position only into an env 'dataset' from "
                                "snakeshard.load_dataset, which keeps the dataset's order; this env has "
                                + (f"a {type(env['dataset']).__name__} 'dataset'" if "dataset" in env else "no 'dataset'"))
        position = k.__index__()
        if not 0 <= position < len(order):
            raise ContractError(f"runner(keys): position {position} is outside the dataset's {len(order)} keys "
                                f"(0 to {len(order) - 1})")
        resolved.append(order[position])
    return resolved


