"""command=synth: deterministic random checkpoints of real architectures, written to disk or generated as they are read."""
