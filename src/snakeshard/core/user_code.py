"""Import the user's classes a job runs: the ``stages.<stage>.runner`` and ``.provider`` paths of the config.

user_source.py checks the same paths at parse time without importing them (find their module, read its syntax
tree). A job imports the class anyway, so it imports first and runs that check only to explain a failure:
the check's modules (importlib.util, ast) would cost every shard job ~5 ms before its first item.
"""

from __future__ import annotations

import importlib

from snakeshard.errors import ConfigError


def import_object(path: str, where: str = "import path"):
    """``package.module.Name`` -> the object; errors name the path and the config key ``where``.

    A module that is found but whose own imports fail (a package that is not installed, beyond what the
    parse checks: user_source.check_module_imports) is a ConfigError naming the key, the failed import and its
    error, caused by that ImportError (a job writes its traceback to the log). Other errors of the module's
    own code are raised as they are, with their traceback.
    """
    module, _, attr = path.rpartition(".")
    try:
        loaded = importlib.import_module(module)
    except ImportError as e:
        _explain(path, where)
        raise _failed_import(path, where, e) from e
    except ValueError:  # no module part ("Runner")
        _explain(path, where)
        raise
    try:
        return getattr(loaded, attr)
    except AttributeError:
        _explain(path, where)
        raise ConfigError(f"{where}: module {module!r} has no attribute {attr!r}") from None


def _explain(path: str, where: str) -> None:
    """Raise the parse-time check's error for ``path`` (no such module, no such name), if it finds one."""
    from snakeshard.core.user_source import check_import_path

    check_import_path(path, where)


def _failed_import(path: str, where: str, error: ImportError) -> ConfigError:
    """The one line for a module that is there but fails importing something: where that import is (the
    deepest frame of the module's own code: importlib's frozen frames aside) and what it said."""
    import sys
    import traceback  # only on failure

    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")]
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    hint = f" (the jobs run {sys.executable})" if isinstance(error, ModuleNotFoundError) else ""
    return ConfigError(f"{where}: importing {path} failed{at}: {error}{hint}")
