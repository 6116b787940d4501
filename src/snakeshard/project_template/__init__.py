"""Files `snakeshard init` writes into a new project (package data, not code snakeshard runs)."""
