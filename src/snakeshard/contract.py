"""The user contract: providers build the environment, runners process items.

Kept compatible in spirit with ESPnet3's parallel runner:

* ``EnvironmentProvider(config)`` builds ``env`` (a dict: dataset, model, ...)
  with ``build_env_local()`` for in-process runs and ``build_worker_setup_fn()``
  for shard jobs, which calls the returned function once per job.
* ``BaseRunner.forward`` is a ``@staticmethod`` whose first parameter receives a
  key (or a list of keys when ``batch_size`` is set) and whose other parameters
  are filled from ``env`` by name; ``**env`` receives everything.
* Hooks shape one shard's life: ``init_state -> (forward -> write_record,
  reduce_state)* -> close_writers -> finalize_state -> done``; ``merge`` runs once
  in the merge rule.
"""

from __future__ import annotations

import inspect
import math
import os
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable

from snakeshard.errors import ContractError

# Names the shard loop passes to hooks itself; an env entry with one of these names would clash.
RESERVED_ENV_NAMES = frozenset({"shard_dir", "writers", "result", "state"})
SCALAR_TYPES = (str, int, float, bool)
_PLAIN_TYPES = frozenset(SCALAR_TYPES)  # exact types whose f-string is str(value)


class EnvironmentProvider:
    """Builds what ``forward`` needs. Subclass and implement ``build_env_local``.

    ``config`` is the stage's ``provider_config`` from config.yaml, plus
    ``config["dataset"]``: the spec of the dataset being processed (pass it to
    ``snakeshard.data.load_dataset``), and in shard jobs ``config["devices"]``:
    ``["cpu"]``, or ``["cuda:0", ...]`` for the GPUs of the job's own allocation.
    """

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})

    def build_env_local(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must implement build_env_local()")

    def build_worker_setup_fn(self) -> Callable[[], dict]:
        """A picklable-in-spirit function a worker calls once to build its env (default: build_env_local)."""
        return self.build_env_local


class InferenceProvider(EnvironmentProvider):
    """A provider whose local env is built once and then reused (models are expensive to load)."""

    _env: dict | None = None

    def build_env_local(self) -> dict:
        if self._env is None:
            self._env = self.build_env()
        return self._env

    def build_worker_setup_fn(self) -> Callable[[], dict]:
        return self.build_env

    def build_env(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must implement build_env()")


class FieldWriters:
    """Default writers: one Kaldi-style ``key value`` text file per scalar result field.

    A NaN or infinite float fails its item (naming key and field) unless the field is in
    ``allow_nonfinite`` (the stage's config; the shard loop sets it). ``close`` fsyncs every file,
    so a ``done`` that survives a power loss never points at fragments that did not.
    """

    allow_nonfinite: frozenset = frozenset()

    def __init__(self, shard_dir: Path):
        self.shard_dir = Path(shard_dir)
        self.files: dict[str, Any] = {}

    def _open(self, name: str, key: str):
        if "/" in name or name in ("keys", "done") or name.startswith("."):
            raise ContractError(f"item {key!r}: result field {name!r} cannot be used as a file name")
        f = open(self.shard_dir / name, "w", encoding="utf-8")
        self.files[name] = f
        return f

    def write(self, result: dict) -> None:
        key = result["key"]
        files = self.files
        for name, value in result.items():
            if name == "key":
                continue
            if type(value) is not str:
                if not isinstance(value, SCALAR_TYPES):
                    raise ContractError(
                        f"item {key!r}: field {name!r} is a {type(value).__name__}; the default writer "
                        "takes str/int/float/bool (override write_record for other types)"
                    )
                if type(value) is float and not math.isfinite(value) and name not in self.allow_nonfinite:
                    raise ContractError(f"item {key!r}: field {name!r} is {value}; list the field under the "
                                        "stage's allow_nonfinite if that is a valid result")
                value = str(value)
            if "\n" in value:
                raise ContractError(f"item {key!r}: field {name!r} holds a newline, which would break the {name} file")
            (files.get(name) or self._open(name, key)).write(f"{key} {value}\n")

    def write_many(self, keys: list[str], results: list) -> bool:
        """Write a slice of results in one go when all are plain: dicts with the same scalar fields,
        no ``key`` field, no newline. Returns False, having written nothing, for anything else
        (the caller then goes item by item, which writes or raises the precise error)."""
        try:
            names = list(results[0])
            if "key" in names or sum(map(len, results)) != len(names) * len(results):
                return False
            columns = [list(map(itemgetter(name), results)) for name in names]
        except (TypeError, KeyError, IndexError):  # not mappings, or same field count with other names
            return False
        blocks = []
        for name, values in zip(names, columns):
            types = set(map(type, values))
            if not types <= _PLAIN_TYPES:
                return False
            if float in types and name not in self.allow_nonfinite and not all(
                    math.isfinite(v) for v in values if type(v) is float):
                return False  # a NaN or inf: the item-by-item path names it
            text = "".join([f"{k} {v}\n" for k, v in zip(keys, values)])
            if text.count("\n") != len(keys):  # a value held a newline
                return False
            blocks.append((name, text))
        for name, text in blocks:
            (self.files.get(name) or self._open(name, keys[0])).write(text)
        return True

    def close(self) -> list[str]:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return sorted(self.files)


class BaseRunner:
    """Subclass, set ``forward`` as a ``@staticmethod``; optionally override the hooks.

    ``MyRunner(provider, output_dir=...)(keys)`` runs the same code path as one
    shard job, in-process (for notebooks and tests). Without ``output_dir`` it
    returns the list of results instead of writing files.
    """

    batch_size: int | None = None  # None: forward gets one key; N: lists of up to N keys
    # Without output_dir, the in-process call returns results and runs no writer hooks
    # and no finalize_state (there is no shard dir to write into).

    def __init__(self, provider: EnvironmentProvider, *, output_dir=None, batch_size: int | None = None,
                 progress: bool = False):
        self.provider = provider
        self.output_dir = output_dir
        self.batch_size = batch_size if batch_size is not None else type(self).batch_size
        self.progress = progress

    def __call__(self, keys: list[str]):
        from snakeshard.shard import run_shard

        env = self.provider.build_env_local()
        return run_shard(type(self), env, list(keys), self.output_dir, batch_size=self.batch_size,
                         progress=self.progress)

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
    def finalize_state(state, shard_dir, **env) -> None:
        """Write the shard's accumulated state (e.g. stats) into ``shard_dir``."""

    # -- writer hooks --
    @staticmethod
    def open_writers(shard_dir, **env):
        return FieldWriters(shard_dir)

    @staticmethod
    def write_record(writers, result, state, **env) -> None:
        writers.write(result)

    @staticmethod
    def close_writers(writers, state, **env) -> list[str]:
        """Close writers; return the names of per-key ``key value`` files the merge concatenates."""
        return writers.close()

    @classmethod
    def merge(cls, shard_dirs: list[Path], output_dir: Path) -> list[str]:
        """Combine shard outputs in ``output_dir``; default: validated concat of per-key fragments."""
        from snakeshard.merge import merge_fragments

        return merge_fragments(shard_dirs, output_dir)


def injected_kwargs(runner_cls: type, env: dict) -> dict:
    """The keyword arguments ``forward`` receives: env entries chosen by parameter name.

    Raises naming the runner and the key when ``forward`` asks for a name the env
    lacks, or the env holds a name the shard loop reserves.
    """
    name = f"{runner_cls.__module__}.{runner_cls.__qualname__}"
    clashes = sorted(RESERVED_ENV_NAMES & set(env))
    if clashes:
        raise ContractError(f"env key {clashes[0]!r} from the provider clashes with a name {name} hooks reserve; rename it")
    if not isinstance(inspect.getattr_static(runner_cls, "forward"), staticmethod):
        raise ContractError(f"{name}.forward must be a @staticmethod")
    params = list(inspect.signature(runner_cls.forward).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ContractError(f"{name}.forward must take the key (or batch of keys) as its first positional parameter")
    first = params[0].name
    if first in env:
        raise ContractError(f"env key {first!r} clashes with the first parameter of {name}.forward; rename one")
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(env)
    kwargs = {}
    for p in params[1:]:
        if p.name in env:
            kwargs[p.name] = env[p.name]
        elif p.default is inspect.Parameter.empty:
            raise ContractError(
                f"{name}.forward needs env key {p.name!r}, but the provider gave only {sorted(env)}"
            )
    return kwargs


def overrides(runner_cls: type, hook: str) -> bool:
    """True if ``runner_cls`` replaces a BaseRunner hook (lets the shard loop skip no-op calls)."""
    return getattr(runner_cls, hook) is not getattr(BaseRunner, hook)
