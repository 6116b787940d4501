"""The digits recipe: the files `snakeshard init --recipe digits` writes (package data; digits.py is the
project's model module, imported from the project, not from here)."""
