"""Demo workload: a small offline PocketSphinx recogniser for the shipped data/demo utterances."""
