"""mlxbun: a declarative, config-driven command suite for MLX model artifacts."""

from pathlib import Path

__version__ = "0.1.0"
# The checkout mlxbun runs from: conf/ and recipes/ sit beside the package.
REPO_ROOT = Path(__file__).resolve().parent.parent
