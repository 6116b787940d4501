"""Files on disk: atomic writes (temp file, fsync, rename), audio reading, the typed output writers (ark/scp, wav,
JSON Lines) and padded batches."""
