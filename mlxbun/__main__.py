"""``python -m mlxbun``: see mlxbun/cli.py."""

from mlxbun.cli import main

if __name__ == "__main__":
    main()
