"""Where the files that ship with snakeshard are: the workflow, its profiles and the demo data.

An installed wheel carries them inside the package (``snakeshard/_workflow``, ``_profiles``,
``_demo_data``), built from the repository's ``workflow/``, ``config/profiles/`` and
``data/demo/`` (see pyproject.toml), so the two never drift. A source checkout (an editable
install) uses the repository's own directories.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_CHECKOUT = PACKAGE_DIR.parents[1]  # src/snakeshard -> the repository root

# packaged name -> the same files in a source checkout
_SHIPPED = {
    "_workflow": "workflow",
    "_profiles": "config/profiles",
    "_demo_data": "data/demo",
}


def shipped_dir(name: str) -> Path:
    """The directory ``name`` (a key of ``_SHIPPED``) in the installed package or the source checkout."""
    for candidate in (PACKAGE_DIR / name, _CHECKOUT / _SHIPPED[name]):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"snakeshard's {_SHIPPED[name]}/ is neither in the package ({PACKAGE_DIR / name}) "
                            f"nor in a source checkout ({_CHECKOUT / _SHIPPED[name]}): reinstall snakeshard")


def workflow_dir() -> Path:
    return shipped_dir("_workflow")


def snakefile() -> str:
    """The workflow's Snakefile, for a project's ``module ...: snakefile: snakeshard.snakefile()``."""
    return str(workflow_dir() / "Snakefile")


def schema_path() -> Path:
    return workflow_dir() / "schemas" / "config.schema.yaml"


def load_schema(path: str | Path | None = None) -> dict:
    """The config's JSON schema (the shipped one unless ``path``), parsed. Every ``snakemake`` start validates the
    config against it: libyaml's loader (in PyYAML's wheels) parses it in 3 ms, the pure-Python one in 35 ms
    (bench/RESULTS.md section 25)."""
    import yaml

    with open(path or schema_path(), encoding="utf-8") as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def profiles_dir() -> Path:
    return shipped_dir("_profiles")


def demo_data_dir() -> Path:
    return shipped_dir("_demo_data")
