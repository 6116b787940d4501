"""Import the user's classes a job runs: the ``stages.<stage>.runner`` and ``.provider`` paths of the config.

workflow.py checks the same paths at parse time without importing them (find their module, read its syntax
tree). A job imports the class anyway, so it imports first and runs that check only to explain a failure:
the check's modules (importlib.util, ast) would cost every shard job ~5 ms before its first item.
"""

from __future__ import annotations

import importlib

from snakeshard.errors import ConfigError


def import_object(path: str, where: str = "import path"):
    """``package.module.Name`` -> the object; errors name the path and the config key ``where``.

    A module that is found but fails in its own code (it imports a package that is not installed)
    raises its own error, with its traceback.
    """
    module, _, attr = path.rpartition(".")
    try:
        loaded = importlib.import_module(module)
    except (ImportError, ValueError):  # ValueError: no module part ("Runner")
        _explain(path, where)
        raise
    try:
        return getattr(loaded, attr)
    except AttributeError:
        _explain(path, where)
        raise ConfigError(f"{where}: module {module!r} has no attribute {attr!r}") from None


def _explain(path: str, where: str) -> None:
    """Raise the parse-time check's error for ``path`` (no such module, no such name), if it finds one."""
    from snakeshard.workflow import check_import_path

    check_import_path(path, where)
