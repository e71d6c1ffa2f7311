"""mlxbun: a declarative, config-driven command suite for MLX model artifacts."""

__version__ = "0.1.0"
