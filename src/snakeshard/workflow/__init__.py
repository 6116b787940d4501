"""The Snakemake glue: the Snakefile's parse (``parse``: config, plans, fingerprints), the shard and training
jobs' entry (``job``), the training stage's config, ``snakeshard init`` (``project``), the config reference, and
the measured Snakemake patches."""
