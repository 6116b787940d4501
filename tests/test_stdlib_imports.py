"""snakeshard uses the standard library's public modules: no module under src/snakeshard imports a
leading-underscore top-level module (``_json``, ``_sha256``, ``_sha2``, ...), whose names and signatures
CPython changes between versions without notice (``_sha256`` became ``_sha2`` in 3.12)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "snakeshard"
IMPORT_FUNCTIONS = {"import_module", "__import__"}  # importlib.import_module("_json"), __import__("_json")


def private_imports(source: str, filename: str) -> list[str]:
    """``line: module`` for each import of a top-level module whose name starts with ``_`` (``__future__``
    excepted), as a statement or as a call with the name written out."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.level == 0 and node.module else []  # relative imports are the package's
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in IMPORT_FUNCTIONS):
            names = [node.args[0].value]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names
                  if name.split(".")[0].startswith("_") and name != "__future__"]
    return found


def test_no_module_of_the_package_imports_a_private_stdlib_module():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 30  # the package's modules, its recipes and templates
    offenders = {str(path.relative_to(SRC)): found for path in files
                 if (found := private_imports(path.read_text(encoding="utf-8"), str(path)))}
    assert offenders == {}


def test_the_check_finds_each_form_of_a_private_import():
    source = """
from __future__ import annotations
import json, _json
from _sha2 import sha256
import _sha256 as small
from . import _local
from .x import y
import importlib
importlib.import_module("_hashlib")
__import__("_blake2")
import os._private_looking
"""
    assert private_imports(source, "example.py") == ["3: _json", "4: _sha2", "5: _sha256", "9: _hashlib",
                                                     "10: _blake2"]
