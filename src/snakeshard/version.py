"""The package's version, in a module of its own: modules under the public API (the shard loop, the workflow)
record it without importing the package's ``__init__``, which imports the contract above them."""

__version__ = "0.1.0"  # the package's version too: pyproject.toml reads it (dynamic = ["version"])
