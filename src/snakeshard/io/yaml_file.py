"""A YAML file's syntax checked before Snakemake reads it, its errors put as ``path:line:column: problem``.

Here, low in the package, because a project's Snakefile calls ``snakeshard.check_config_file`` (exposed by the
package itself) before its ``configfile:`` line, and ``workflow.config_file`` words ``snakeshard status``'s
errors the same way.
"""

from __future__ import annotations

import os
import sys

from snakeshard.errors import ERROR_PREFIX


def check_config_file(path: str | os.PathLike) -> None:
    """For a project's Snakefile, before its ``configfile:`` line: a YAML syntax error ends the run with one
    ``snakeshard: error:`` line naming file, line and column, where Snakemake's own message names neither (a user
    trial). A missing file is left to Snakemake, whose message names it."""
    if not os.path.isfile(path):
        return
    import yaml

    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1 ms, not 8, in every SLURM job
    except yaml.YAMLError:
        try:
            yaml.safe_load(text)  # as load_config reads it, so that `snakeshard status` words the error the same
        except yaml.YAMLError as e:
            print(ERROR_PREFIX + yaml_error_message(path, e), file=sys.stderr, flush=True)
            raise SystemExit(1) from None  # what Snakemake passes on without a traceback


def yaml_error_message(path: str | os.PathLike, error) -> str:
    """PyYAML's error (four lines: context, its place, problem, its place) as ``path:line:column: problem (context
    that starts at line N)``, the form compilers and linters use."""
    mark = getattr(error, "problem_mark", None)
    if mark is None or not getattr(error, "problem", None):
        return f"config file {path} is not valid YAML: {error}"
    context = ""
    if getattr(error, "context", None) and error.context_mark is not None:
        context = f" ({error.context} that starts at line {error.context_mark.line + 1})"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {error.problem}{context}"
