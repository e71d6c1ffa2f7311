"""The config: the schema Hydra composes every run against, its sections and their checks, and
the keys each command reads."""
