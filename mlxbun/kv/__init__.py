"""Persisted prompt KV caches: atomic single-file snapshots or deduplicated blocks, verify and GC.

``Store`` (mlxbun.kv.store) is the library API; ``mlxbun.kv.commands``, ``gc``, ``import_`` and
``export`` hold the ``kv_*`` commands. Snapshot files are mlx-lm prompt-cache files
(mlxbun.kv.promptcache); the mlxbun header and block manifests are drawn in mlxbun.kv.format.
"""
