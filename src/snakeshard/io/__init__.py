"""Files on disk: atomic writes (temp file, fsync, rename), audio reading, the typed output writers (ark/scp, wav,
JSON Lines), padded batches, and a config file's YAML syntax checked with its line."""
