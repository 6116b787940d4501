"""How a runner's hooks are called: which env entries each static method receives, by parameter name.

The shard loop (shard.py), the worker pool and the training loop call a runner's hooks through these
helpers; the contract (contract.py: providers and BaseRunner, the API users subclass) sits above them.
Reading a hook's parameters needs no import of the runner's base class, so the shard loop does not
import the contract whose in-process call (``runner(keys)``) runs the shard loop.
"""

from __future__ import annotations

from snakeshard.errors import ContractError

# Names the shard loop passes to hooks itself; an env entry with one of these names would clash.
RESERVED_ENV_NAMES = frozenset({"shard_dir", "writers", "result", "state"})

# How each hook is called, always on the runner class: the env hooks by shard jobs (shard.py), with these
# positional arguments and every env entry by name; merge by the merge rule (merge.merge_set) and report by
# the report rule (cli.cmd_report), with these positional arguments only. The parse checks the hooks a
# runner's own class body defines against them (user_source.check_runner_source).
ENV_HOOKS = {
    "init_state": (),
    "open_writers": ("shard_dir",),
    "item_length": ("key",),
    "write_record": ("writers", "result", "state"),
    "reduce_state": ("state", "result"),
    "close_writers": ("writers", "state"),
    "finalize_state": ("state", "shard_dir"),
}
STEP_METHODS = ("forward", "train_step", "evaluate_step", "infer_step")  # a runner's per-item (or per-batch) methods
CLASS_HOOKS = {"merge": ("shard_dirs", "output_dir"), "report": ("set_dir", "name", "path")}


def hook_signature(hook: str) -> str:
    """The signature a runner defines ``hook`` with, as the contract gives it (``@staticmethod close_writers(writers,
    state, **env)``)."""
    if hook in ENV_HOOKS:
        return f"@staticmethod {hook}({', '.join([*ENV_HOOKS[hook], '**env'])})"
    return f"@classmethod {hook}({', '.join(['cls', *CLASS_HOOKS[hook]])})"


def injected_kwargs(runner_cls: type, env: dict) -> dict:
    """The keyword arguments ``forward`` receives: env entries chosen by parameter name.

    Raises naming the runner and the key when ``forward`` asks for a name the env
    lacks, or the env holds a name the shard loop reserves.
    """
    name = runner_name(runner_cls)
    if not isinstance(env, dict):  # a provider's build method that returns nothing, or the wrong thing
        raise ContractError(f"the provider built {type(env).__name__}, not an env (a dict of the names {name}.forward "
                            "takes): its build_env_local / build_env / build_worker_setup_fn()() must return a dict")
    clashes = sorted(RESERVED_ENV_NAMES & set(env))
    if clashes:
        raise ContractError(f"env key {clashes[0]!r} from the provider clashes with a name {name} hooks reserve; rename it")
    return method_kwargs(runner_cls, "forward", env, "the key (or batch of keys)")


def method_kwargs(runner_cls: type, method: str, env: dict, first: str) -> dict:
    """The env entries the static method ``runner_cls.<method>`` receives, chosen by parameter name (all of them
    with ``**env``); ``first`` says what its first positional parameter receives. Raises naming runner and method
    when it is no staticmethod, takes no first parameter, or needs a name the env lacks."""
    name = f"{runner_name(runner_cls)}.{method}"
    if not isinstance(class_attribute(runner_cls, method), staticmethod):
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
    entry and gets every name it requires. The parse checks what a hook's source shows (user_source.check_runner_source);
    which names the env holds is known only here. Raises naming runner, hook and names, instead of the TypeError
    its first call would raise (outside the item loop: a raw traceback in every job)."""
    for hook, given in ENV_HOOKS.items():
        attribute = class_attribute(runner_cls, hook)
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


def class_attribute(cls: type, name: str):
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


def overrides(cls: type, hook: str) -> bool:
    """True if a subclass replaces ``hook`` of the class that introduced it (for a runner, BaseRunner's no-op
    defaults: lets the shard loop skip their calls without importing the contract)."""
    defining = [klass for klass in cls.__mro__ if hook in klass.__dict__]
    return len(defining) > 1 and defining[0] is not defining[-1]


def runner_name(runner_cls: type) -> str:
    """``module.Class``: how errors name a runner."""
    return f"{runner_cls.__module__}.{runner_cls.__qualname__}"
