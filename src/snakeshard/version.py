"""The package's version, in a module of its own: modules under the public API (the shard loop, the workflow)
record it without importing the package's ``__init__``, which imports the contract above them."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's version
