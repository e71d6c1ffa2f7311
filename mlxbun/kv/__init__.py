"""Persisted prompt KV caches: atomic single-file snapshots or deduplicated blocks, verify and GC.

``Store`` (mlxbun.kv.store) is the library API; ``mlxbun.kv.commands`` and ``mlxbun.kv.gc`` hold
the ``kv_*`` commands. The byte format is drawn in mlxbun.kv.format.
"""
