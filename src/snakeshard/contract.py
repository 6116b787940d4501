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

from snakeshard.errors import ContractError
from snakeshard.writers import FieldWriters

# Names used only in annotations: importing them costs a shard job ~8 ms before its first item
# (pathlib 5 ms, bench/RESULTS.md section 16; typing 3 ms). Type checkers read TYPE_CHECKING = False as typing's.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

# Names the shard loop passes to hooks itself; an env entry with one of these names would clash.
RESERVED_ENV_NAMES = frozenset({"shard_dir", "writers", "result", "state"})

# How each hook is called, always on the runner class: the env hooks by shard jobs (shard.py), with these
# positional arguments and every env entry by name; merge by the merge rule (merge.merge_set) and report by
# the report rule (cli.cmd_report), with these positional arguments only. The parse checks the hooks a
# runner's own class body defines against them (workflow.check_runner_source).
ENV_HOOKS = {
    "init_state": (),
    "open_writers": ("shard_dir",),
    "item_length": ("key",),
    "write_record": ("writers", "result", "state"),
    "reduce_state": ("state", "result"),
    "close_writers": ("writers", "state"),
    "finalize_state": ("state", "shard_dir"),
}
CLASS_HOOKS = {"merge": ("shard_dirs", "output_dir"), "report": ("set_dir", "name", "path")}


def hook_signature(hook: str) -> str:
    """The signature a runner defines ``hook`` with, as the contract gives it (``@staticmethod close_writers(writers,
    state, **env)``)."""
    if hook in ENV_HOOKS:
        return f"@staticmethod {hook}({', '.join([*ENV_HOOKS[hook], '**env'])})"
    return f"@classmethod {hook}({', '.join(['cls', *CLASS_HOOKS[hook]])})"


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
        """The env of an in-process run (``runner(keys)``). Default: ``build_worker_setup_fn()()``, when a
        subclass overrides only that (ESPnet3's worker-setup style): in-process and shard jobs then build
        the env alike."""
        if overrides(type(self), "build_worker_setup_fn", EnvironmentProvider):
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
        from snakeshard.shard import run_shard

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
                                "'dataset' from snakeshard.data.load_dataset, or override item_length(key, **env)")
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
        from snakeshard.merge import merge_fragments

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
    ``snakeshard.data`` dataset, whose keys keep the dataset's file order (the plan's): ``range(2)`` is
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
                                "snakeshard.data.load_dataset, which keeps the dataset's order; this env has "
                                + (f"a {type(env['dataset']).__name__} 'dataset'" if "dataset" in env else "no 'dataset'"))
        position = k.__index__()
        if not 0 <= position < len(order):
            raise ContractError(f"runner(keys): position {position} is outside the dataset's {len(order)} keys "
                                f"(0 to {len(order) - 1})")
        resolved.append(order[position])
    return resolved


def injected_kwargs(runner_cls: type, env: dict) -> dict:
    """The keyword arguments ``forward`` receives: env entries chosen by parameter name.

    Raises naming the runner and the key when ``forward`` asks for a name the env
    lacks, or the env holds a name the shard loop reserves.
    """
    name = runner_name(runner_cls)
    clashes = sorted(RESERVED_ENV_NAMES & set(env))
    if clashes:
        raise ContractError(f"env key {clashes[0]!r} from the provider clashes with a name {name} hooks reserve; rename it")
    return method_kwargs(runner_cls, "forward", env, "the key (or batch of keys)")


def method_kwargs(runner_cls: type, method: str, env: dict, first: str) -> dict:
    """The env entries the static method ``runner_cls.<method>`` receives, chosen by parameter name (all of them
    with ``**env``); ``first`` says what its first positional parameter receives. Raises naming runner and method
    when it is no staticmethod, takes no first parameter, or needs a name the env lacks."""
    name = f"{runner_name(runner_cls)}.{method}"
    if not isinstance(_class_attribute(runner_cls, method), staticmethod):
        raise ContractError(f"{name} must be a @staticmethod")
    param, named, required, takes_any = forward_parameters(getattr(runner_cls, method))
    if param is None:
        raise ContractError(f"{name} must take {first} as its first positional parameter")
    if param in env:
        raise ContractError(f"env key {param!r} clashes with the first parameter of {name}; rename one")
    if takes_any:
        return dict(env)
    missing = [p for p in required if p not in env]
    if missing:
        raise ContractError(f"{name} needs env key {missing[0]!r}, but the provider gave only {sorted(env)}")
    return {p: env[p] for p in named if p in env}


def check_hook_env(runner_cls: type, env: dict) -> None:
    """The env hooks ``runner_cls`` overrides take this env by name: a hook without ``**env`` names every env
    entry and gets every name it requires. The parse checks what a hook's source shows (workflow.check_runner_source);
    which names the env holds is known only here. Raises naming runner, hook and names, instead of the TypeError
    its first call would raise (outside the item loop: a raw traceback in every job)."""
    for hook, given in ENV_HOOKS.items():
        attribute = _class_attribute(runner_cls, hook)
        function = getattr(attribute, "__func__", attribute)  # a staticmethod's or classmethod's function
        code = getattr(function, "__code__", None)
        if code is None or hasattr(function, "__wrapped__") or code.co_flags & _VARKEYWORDS:
            continue  # takes **env, or not a plain function: its call says what it takes
        passed = len(given) + isinstance(attribute, classmethod)  # the call's positional arguments (and cls)
        names = code.co_varnames[max(passed, code.co_posonlyargcount):code.co_argcount + code.co_kwonlyargcount]
        defaults = set(function.__kwdefaults__ or ())
        defaults |= set(code.co_varnames[code.co_argcount - len(function.__defaults__ or ()):code.co_argcount])
        name = f"{runner_name(runner_cls)}.{hook}"
        missing = [n for n in names if n not in env and n not in defaults]
        if missing:
            raise ContractError(f"{name} needs env key {missing[0]!r}, but the provider gave only {sorted(env)}")
        extra = sorted(set(env) - set(names))
        if extra:
            raise ContractError(f"{name} takes no **env, and the env holds {extra[:5]} besides the names it takes "
                                f"({list(names)}): shard jobs pass every env entry by name; define it as "
                                f"{hook_signature(hook)}")


def _class_attribute(cls: type, name: str):
    """``name`` as stored in the class dicts of ``cls``'s MRO (a staticmethod stays one), like
    ``inspect.getattr_static`` for a class attribute."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


_VARKEYWORDS = 0x08  # the code flag inspect.CO_VARKEYWORDS: the function takes **kwargs


def forward_parameters(forward) -> tuple[str | None, list[str], set[str], bool]:
    """What injection needs of ``forward``'s signature: the first positional parameter's name (None if
    there is none), the names after it, those of them without a default, and whether it takes ``**env``.

    A plain function is read from its code object: `inspect` costs ~10 ms to import, in every shard job
    before its first item. Anything else (a decorated function with ``__wrapped__``, a partial, a
    callable object) goes through ``inspect.signature``, which knows all of them.
    """
    code = getattr(forward, "__code__", None)
    if code is None or hasattr(forward, "__wrapped__") or not hasattr(forward, "__defaults__"):
        return _parameters_by_inspect(forward)
    n_positional, n_keyword_only = code.co_argcount, code.co_kwonlyargcount
    positional = list(code.co_varnames[:n_positional])
    keyword_only = list(code.co_varnames[n_positional:n_positional + n_keyword_only])
    takes_any = bool(code.co_flags & _VARKEYWORDS)
    if not positional:
        return None, [], set(), takes_any
    n_defaults = len(forward.__defaults__ or ())
    required = set(positional[1:n_positional - n_defaults])
    required |= {p for p in keyword_only if p not in (forward.__kwdefaults__ or {})}
    return positional[0], positional[1:] + keyword_only, required, takes_any


def _parameters_by_inspect(forward) -> tuple[str | None, list[str], set[str], bool]:
    import inspect

    params = list(inspect.signature(forward).parameters.values())
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return None, [], set(), takes_any
    named = [p for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return (params[0].name, [p.name for p in named], {p.name for p in named if p.default is p.empty}, takes_any)


def overrides(cls: type, hook: str, base: type | None = None) -> bool:
    """True if ``cls`` replaces ``base``'s ``hook`` (default base: BaseRunner; lets the shard loop skip no-op calls)."""
    return getattr(cls, hook) is not getattr(base or BaseRunner, hook)


def runner_name(runner_cls: type) -> str:
    """``module.Class``: how errors name a runner."""
    return f"{runner_cls.__module__}.{runner_cls.__qualname__}"
