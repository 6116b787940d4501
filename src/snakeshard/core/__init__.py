"""The core: what every stage shares.

plan          shards from a dataset's keys (by count, keys or seconds) and the per-job slices
shard         the shard loop: env built once, forward over items or batches, fragments, an atomic ``done``
merge         checks a set's shard outputs against the plan and concatenates them
merged_files  a set's merged.json and the files it lists; their removal when a shard runs again
contract      the user API: ``EnvironmentProvider``, ``InferenceProvider``, ``BaseRunner``
data          datasets (Kaldi dirs, JSON Lines, a chained stage's merged output) and ``load_dataset``
fingerprint   digests of records, audio and config that decide what reruns
user_code / user_source   importing a config's classes; reading their literals without importing
forked        a big manifest's planning spread over forked processes
shard_pool / hooks / devices / set_summary / progress / shard_files   their helpers
"""
