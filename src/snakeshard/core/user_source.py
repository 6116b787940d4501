"""The user's runner and provider modules, read at parse time without importing them.

A misspelt ``module.Class`` path, a package the module imports that is not installed, a hook defined with a
signature the shard loop cannot call, a runner's literal ``default_sharding`` or ``reports``: all found from
the module's source (``importlib.util.find_spec``, ``ast``), so a parse imports no user code (it runs at every
``snakemake`` start, and on SLURM in every job). user_code.py imports the class in a job.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from snakeshard.core.fingerprint import digest
from snakeshard.core.hooks import CLASS_HOOKS, ENV_HOOKS, STEP_METHODS, hook_signature
from snakeshard.errors import ConfigError
from snakeshard.moved import new_path

SNAKESHARD_DIR = Path(__file__).resolve().parents[1]  # the package's own modules: its version counts, not them


def check_import_path(path: str, where: str):
    """Fail early on a misspelt ``module.Class`` path without importing the (heavy) module itself.

    Returns (source file, parsed module) for further checks, or None for a module without Python source.
    """
    module, attr, origin = _locate(path, where)
    if origin is None:
        return None
    tree = _parse(origin, where)
    names = _top_level_names(tree)
    if attr not in names:
        import difflib

        close = difflib.get_close_matches(attr, sorted(names), n=1) if isinstance(names, set) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}: cannot import {path!r}: module {module!r} ({origin}) defines no {attr!r}{hint}")
    return origin, tree


def check_module_imports(path: str, where: str, origin: str, tree) -> None:
    """The packages the module defining ``path`` imports at its top are installed: looked up with
    ``importlib.util.find_spec``, not imported (parse time imports no user code). A missing one would fail
    every shard job at its first line; here it fails the parse once, naming key, file, line and package.

    Looked up: the top-level package of each ``import a.b`` / ``from a.b import c`` before the module's first
    other statement (its docstring and plain ``name = ...`` assignments aside). A later import may depend on
    what such a statement does (``sys.path.insert(...)``, ``pyximport.install()``), and one inside ``try:`` or
    ``if`` may be meant to fail; ``a.b`` itself is not looked up (that imports ``a``), nor a relative import
    (the module's own package). What this interpreter finds, the jobs import: they run it too
    ($SNAKESHARD_PYTHON, see common.smk). Imports it misses fail in the job, naming the key (user_code).
    """
    import ast

    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.level == 0 and node.module != "__future__" else []
        elif _docstring_or_name_assignment(node):
            continue
        else:
            return
        for name in names:
            package = name.partition(".")[0]
            if not _findable(package):
                raise ConfigError(f"{where}: {origin}:{node.lineno} imports {name!r}, but no module named {package!r} "
                                  f"is installed for {sys.executable}: every shard job would fail importing {path}")


def _docstring_or_name_assignment(node) -> bool:
    """A docstring, or ``name = ...`` (``log = logging.getLogger(__name__)``) between a module's imports."""
    import ast

    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return bool(targets) and all(isinstance(target, ast.Name) for target in targets)


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # already imported without a spec (__main__): it is there
        return True


def runner_default_sharding(path: str, where: str) -> dict | None:
    """A stage without ``sharding`` takes its runner's ``default_sharding``, a literal class attribute
    read from the runner's source (parse time imports no runner): e.g. CollectStatsRunner shards by audio
    seconds, since a frontend's cost is linear in audio. None when the runner declares none."""
    sharding = class_literal(path, "default_sharding", f"{where}.runner")
    return None if sharding is None else dict(sharding)


def runner_reports(path: str, where: str) -> list[str]:
    """The PNG files a runner draws after its merge for ``snakemake --report`` (its literal ``reports``
    attribute, e.g. ScoringRunner's ``metrics.png``); the workflow's report rule asks its ``report``."""
    reports = list(class_literal(path, "reports", f"{where}.runner") or ())
    bad = [name for name in reports if not (isinstance(name, str) and name.endswith(".png") and "/" not in name)]
    if bad:
        raise ConfigError(f"{where}.runner: {path}.reports lists {bad[0]!r}: reports are PNG file names (x.png)")
    return reports


def provider_merge_options(path: str, where: str) -> tuple[str, ...]:
    """The provider_config options with which the provider reads its chained dataset's merged output (its literal
    ``reads_upstream_merge``, e.g. FbankProvider's ``("global_mvn",)``; see EnvironmentProvider)."""
    options = class_literal(path, "reads_upstream_merge", where)
    if options is None:
        return ()
    if not (isinstance(options, (tuple, list)) and all(isinstance(name, str) for name in options)):
        raise ConfigError(f"{where}: {path}.reads_upstream_merge is {options!r}: a tuple of provider_config "
                          "option names")
    return tuple(options)


def provider_config_keys(path: str, where: str) -> tuple[str, ...] | None:
    """The provider_config keys the provider takes (its literal ``config_keys``; see EnvironmentProvider), or None
    when it declares none."""
    keys = class_literal(path, "config_keys", where)
    if keys is None:
        return None
    if not (isinstance(keys, (tuple, list)) and all(isinstance(name, str) for name in keys)):
        raise ConfigError(f"{where}: {path}.config_keys is {keys!r}: a tuple of provider_config key names")
    return tuple(keys)


def builtin_config_check(path: str, where: str):
    """The ``check_config(provider_config, where)`` of a provider of snakeshard's own stages (``snakeshard.stages``),
    which refuses bad values at parse as the canary would (a misspelt metric); None for a user's provider (the parse
    imports no user module) and for a built-in one that defines none (read from its source: no import for it)."""
    module, attr, _ = _locate(path, where)
    if not module.startswith("snakeshard.stages.") or not defines_method(path, "check_config", where):
        return None
    import importlib

    return getattr(importlib.import_module(module), attr).check_config


COLLECT_STATS_RUNNER = "snakeshard.stages.collect_stats.CollectStatsRunner"


def is_collect_stats_runner(path: str, where: str) -> bool:
    """Whether the runner ``path`` is snakeshard's CollectStatsRunner (by any path that re-exports it, e.g.
    ``snakeshard.stages.CollectStatsRunner``) or a class whose own source names it as a base: the stages whose
    merged output holds ``feats_stats.npz``, what a training stage's ``stats:`` reads."""
    module, attr, _ = _locate(path, where)
    if f"{module}.{attr}" == COLLECT_STATS_RUNNER:
        return True
    found = check_import_path(path, where)
    node = _top_level_classes(found[1]).get(attr) if found else None
    return node is not None and any(base.rpartition(".")[2] == "CollectStatsRunner" for base in _base_names(node))


# Base classes of snakeshard's that define no step of their own (their steps raise NotImplementedError).
STEPLESS_BASES = ("TorchRunner", "BaseRunner")


def defines_method(path: str, method: str, where: str) -> bool | None:
    """Whether the class ``path`` defines ``method``, read from its module's source: in its own body, or in a base
    class defined in the same module (followed up). False only when every base is one of ``STEPLESS_BASES`` or a
    class of that module lacking it; None (unknown) when a base comes from elsewhere or there is no source."""
    import ast

    found = check_import_path(path, where)
    if found is None:
        return None
    classes = _top_level_classes(found[1])
    todo, seen = [path.rpartition(".")[2]], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = classes.get(name)
        if node is None:
            return None
        if any(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Assign)) and method in _bound_names(item)
               for item in node.body):
            return True
        todo += [base for base in _base_names(node) if base.rpartition(".")[2] not in STEPLESS_BASES]
    return False


def _bound_names(item) -> set[str]:
    """The names a class-body statement binds: a def's name, an assignment's plain targets."""
    if hasattr(item, "name"):
        return {item.name}
    return {getattr(target, "id", None) for target in item.targets}


def class_literal(path: str, name: str, where: str):
    """The literal value of class attribute ``name`` in the class's own source (None if it sets none); ``where``:
    the config key naming the class."""
    import ast

    found = check_import_path(path, where)
    for item in _class_body(found[1], path) if found else ():
        target = (item.targets[0] if isinstance(item, ast.Assign) and len(item.targets) == 1
                  else item.target if isinstance(item, ast.AnnAssign) and item.value is not None else None)
        if getattr(target, "id", None) == name:
            try:
                return ast.literal_eval(item.value)
            except (ValueError, TypeError, SyntaxError):  # a name or a call: silently None would turn a check off
                raise ConfigError(f"{where}: {path}.{name} = {ast.unparse(item.value)} ({found[0]}:{item.lineno}) is "
                                  "not a literal: snakeshard reads it from the source at parse, without importing "
                                  "the module; write its value out (a tuple, list, dict, string or number)") from None
    return None


def check_runner_source(path: str, where: str, origin: str, tree) -> None:
    """Contract mistakes visible in the runner's source ``tree`` (parsed by ``check_import_path``).

    A ``forward`` without ``@staticmethod`` would fail in every shard job (they call it on the class), and so
    would a hook that cannot take the call the workflow makes (hooks.ENV_HOOKS, CLASS_HOOKS): ESPnet3's
    ``close_writers(writers)``, a ``merge(self, shard_dirs)`` written as an instance method.
    Only a ``forward`` or hook defined in the class itself is checked; inherited ones are checked in the job.
    """
    import ast

    for item in _class_body(tree, path):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in {**ENV_HOOKS, **CLASS_HOOKS}:
            problem = _hook_problem(item)
            if problem:
                hook = item.name
                if hook in ENV_HOOKS:
                    caller = (f"shard jobs call it on the class as {hook}({', '.join([*ENV_HOOKS[hook], '**env'])}), "
                              "with every env entry by name")
                else:
                    caller = f"the {hook} rule calls it on the class as {hook}({', '.join(CLASS_HOOKS[hook])})"
                decorators = "".join(f"@{ast.unparse(d)} " for d in item.decorator_list)
                raise ConfigError(f"{where}: {path}.{hook} ({origin}:{item.lineno}) is defined as {decorators}{hook}("
                                  f"{ast.unparse(item.args)}), but {caller}, and {problem}: define it as "
                                  f"{hook_signature(hook)}")
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in STEP_METHODS:
            decorators = {d.id for d in item.decorator_list if isinstance(d, ast.Name)}
            decorators |= {d.attr for d in item.decorator_list if isinstance(d, ast.Attribute)}
            first = "the key (or a batch of keys)" if item.name == "forward" else "the batch (a list of keys)"
            if "staticmethod" not in decorators:
                raise ConfigError(f"{where}: {path}.{item.name} ({origin}:{item.lineno}) must be a @staticmethod: "
                                  f"jobs call it on the class, with {first} first and env entries by name")
            args = item.args
            if not (args.posonlyargs or args.args):
                raise ConfigError(f"{where}: {path}.{item.name} ({origin}:{item.lineno}) must take {first} as its "
                                  "first positional parameter")


def _hook_problem(item) -> str | None:
    """Why the hook ``item`` (a ``def`` in a runner's class body) cannot take the call the workflow makes, or None.

    The env hooks are @staticmethods (a @classmethod whose parameters after ``cls`` fit works too) taking the
    positional arguments the call passes (hooks.ENV_HOOKS) and the env by name: ``**env``, or env names
    (keyword-only parameters; a positional one after those needs a default, or ``(self, writers, state)`` would
    pass as ``(writers, state)``). ``merge`` and ``report`` are @classmethods (or @staticmethods)
    taking their positional arguments, and nothing without a default besides. A hook with another decorator too
    is left to the job: the decorator may change its signature.
    """
    import ast

    hook = item.name
    env = hook in ENV_HOOKS
    kinds = {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else None
             for d in item.decorator_list}
    if "staticmethod" not in kinds and "classmethod" not in kinds:
        return f"it is not a @{'staticmethod' if env else 'classmethod'}"
    if len(item.decorator_list) > 1:
        return None
    given = ENV_HOOKS[hook] if env else CLASS_HOOKS[hook]
    args = item.args
    positional = [*args.posonlyargs, *args.args]
    defaults = {p.arg for p in positional[len(positional) - len(args.defaults):]} if args.defaults else set()
    if "classmethod" in kinds:
        if not positional and not args.vararg:
            return "it takes no parameter for the class (cls)"
        positional = positional[1:]
    if len(positional) < len(given) and not args.vararg:
        return (f"it takes {len(positional)} positional parameter{'s' if len(positional) != 1 else ''} where the call "
                f"passes {len(given)}")
    extra = positional[len(given):]
    for param in extra:
        if param.arg not in defaults:  # (self, writers, state) would take the call's writers for self
            return (f"its parameter {param.arg!r}, after the {len(given)} the call passes, has no default"
                    + (" (an env name there must be keyword-only: after *)" if env else ""))
    if not env:
        missing = [k.arg for k, default in zip(args.kwonlyargs, args.kw_defaults) if default is None]
        if missing:
            return f"its keyword-only parameter {missing[0]!r} has no default, and the call gives it no value"
    elif not (args.kwarg or extra or args.kwonlyargs):  # (writers, state) alone: any env entry is one too many
        return "it takes no **env (nor any env name), so the first env entry fails the call"
    return None


def _class_body(tree, path: str) -> list:
    """The statements of the class ``path`` names, as defined at top level of the module ``tree`` ([] if not)."""
    node = _top_level_classes(tree).get(path.rpartition(".")[2])
    return node.body if node is not None else []


def _top_level_classes(tree) -> dict:
    """The classes the module ``tree`` defines at its top level, by name."""
    import ast

    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _base_names(node) -> list[str]:
    """The base classes of the class ``node`` as its source writes them (``Base``, ``module.Base``)."""
    import ast

    return [ast.unparse(base) for base in node.bases]


def _locate(path: str, where: str) -> tuple[str, str, str | None]:
    """(module, attribute, module source file or None) of ``package.module.Name``; errors name ``where``.

    A name a package re-exports (``from .collect_stats import CollectStatsRunner`` in
    ``snakeshard/stages/__init__.py``) is followed to the module that defines it: that module's source
    is what the checks read and the code fingerprint digests.
    """
    for _ in range(5):  # re-export hops
        module, attr, origin = _find(path, where)
        source = _reexported_from(module, attr, origin, where) if origin else None
        if source is None:
            return module, attr, origin
        path = source
    return module, attr, origin


def _reexported_from(module: str, attr: str, origin: str, where: str) -> str | None:
    """``other.module.Name`` if ``module`` binds ``attr`` only by ``from other.module import Name``."""
    import ast

    tree = _parse(origin, where)
    found = None
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
            return None
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == attr:
                    package = module if origin.endswith("__init__.py") else module.rpartition(".")[0]
                    for _ in range(max(node.level - 1, 0)):
                        package = package.rpartition(".")[0]
                    base = package if node.level else ""
                    target = ".".join(part for part in (base, node.module or "") if part)
                    found = f"{target}.{alias.name}"
    return found


def _find(path: str, where: str) -> tuple[str, str, str | None]:
    module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ConfigError(f"{where}: {path!r} is not an import path like 'package.module.ClassName'")
    moved = new_path(path)
    if moved is not None:
        raise ConfigError(f"{where}: {path!r} moved to {moved!r} (snakeshard's modules went into subpackages)")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{where}: cannot import {path!r}: {e}") from None
    if found is None:
        raise ConfigError(f"{where}: cannot import {path!r}: no module named {module!r} "
                          f"(modules are looked up in the working directory {os.getcwd()} and the installed packages)")
    origin = found.origin if found.origin and found.origin.endswith(".py") else None
    return module, attr, origin


_PARSED: dict[tuple[str, int, int], object] = {}


def _parse(source_path: str, where: str):
    """The module's syntax tree, parsed once per parse of the Snakefile (keyed by the file's identity).

    A syntax error names the config key ``where`` as well as file and line: every job would fail importing it.
    """
    import ast

    st = os.stat(source_path)
    key = (source_path, st.st_size, st.st_mtime_ns)
    if key not in _PARSED:
        try:
            _PARSED[key] = ast.parse(Path(source_path).read_bytes(), filename=source_path)
        except SyntaxError as e:
            raise ConfigError(f"{where}: {source_path}:{e.lineno}: {e.msg}: the shard jobs could not import "
                              "this module") from None
    return _PARSED[key]


def source_digest(path: str, where: str) -> str | dict | None:
    """Digest of the module that defines ``path`` (a ``module.Class``), found and parsed without importing it,
    and of the project's own modules it imports (project_modules): then ``{"source": ..., "imports": {file:
    ...}}``. The syntax trees, not the bytes: editing a comment or reformatting reruns nothing, editing code
    does (a researcher's trial: a model moved into its own module was edited, and nothing retrained). None
    without Python source."""
    import ast

    origin = _locate(path, where)[2]
    if origin is None:
        return None
    own = digest(ast.dump(_parse(origin, where)))
    imports = {name: digest(ast.dump(_parse(file, where))) for name, file in project_modules(origin, where).items()}
    return {"source": own, "imports": imports} if imports else own


def code_change(key: str) -> str:
    """A changed code digest's dotted key (fingerprint.differences over source_digest's values) in words."""
    role, _, part = key.removeprefix("code.").partition(".")
    if part.startswith("imports."):
        return f"code.{role}: {part.removeprefix('imports.')} (a module of the project that it imports)"
    if part == "imports":
        return f"code.{role} (the modules of the project that it imports)"
    return f"code.{role} (its source code)"


def project_modules(origin: str, where: str) -> dict[str, str]:
    """The project's own modules that the module in ``origin`` imports, directly or through each other, at any
    depth and wherever the import is (a function body too): name (the file under the working directory) ->
    file. The project's: a file under the working directory, outside any site-packages (a venv kept in the
    project is not its code) and not snakeshard's (its version counts in the stage fingerprint). Looked up with
    ``find_spec`` for top-level names and by path below them, so nothing is imported."""
    root = Path.cwd().resolve()
    start = Path(origin).resolve()
    if start.is_relative_to(SNAKESHARD_DIR):  # a built-in stage: snakeshard's version counts instead
        return {}
    found: dict[Path, None] = {start: None}
    todo = [start]
    while todo:
        current = todo.pop()
        for candidate in _imported_files(_parse(str(current), where), current):
            if candidate not in found and _is_project_file(candidate, root):
                found[candidate] = None
                todo.append(candidate)
    return {str(file.relative_to(root)): str(file) for file in sorted(found) if file != start}


def _is_project_file(file: Path, root: Path) -> bool:
    return (file.is_relative_to(root) and not file.is_relative_to(SNAKESHARD_DIR)
            and not {"site-packages", "dist-packages"} & set(file.parts))


def _imported_files(tree, file: Path):
    """The source files of the modules the statements ``import a.b`` and ``from a.b import c`` (``c`` being a
    module or a name) and relative imports in ``tree`` name, as far as they exist."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _module_files(alias.name.split("."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # `c` a submodule, or a name: then the walk stops at a.b's own file
                yield from _module_files([*node.module.split("."), alias.name])
        elif isinstance(node, ast.ImportFrom):  # relative: from the importing file's package
            base = file.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*node.module.split(".")) if node.module else base
            for path in (target, *(target / alias.name for alias in node.names)):
                yield from _source_file(path)


def _module_files(parts: list[str]):
    """The source file of the module ``parts`` names: its top-level package by ``find_spec`` (which imports
    nothing for a top-level name), the rest by path; nothing for a name that is not a module of source."""
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return
    if spec is None:
        return
    if spec.origin and spec.origin.endswith(".py"):
        path = Path(spec.origin).resolve()
    elif spec.submodule_search_locations:  # a package without __init__.py (a namespace package)
        path = None
    else:
        return
    dirs = ([Path(d) for d in spec.submodule_search_locations or ()] if path is None
            else [path.parent] if path.name == "__init__.py" else [])
    for part in parts[1:]:  # a name in a module (not a package) ends the walk: it is no submodule
        found = next((file for folder in dirs for file in _source_file(folder / part)), None)
        if found is None:
            break
        path, dirs = found, [found.parent] if found.name == "__init__.py" else []
    if path is not None:
        yield path


def _source_file(path: Path):
    """``path``.py or ``path``/__init__.py, resolved, where one exists."""
    for file in (path.with_name(path.name + ".py"), path / "__init__.py"):
        if file.is_file():
            yield file.resolve()
            return


def _top_level_names(tree) -> set[str] | _AnyName:
    """Names a module binds at top level.

    A star import or a module ``__getattr__`` can bind any name: then every name is accepted.
    """
    import ast

    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return _AnyName()
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            return _AnyName()  # conditional definitions: do not guess
    return _AnyName() if "__getattr__" in names else names


class _AnyName:
    def __contains__(self, name) -> bool:
        return True


