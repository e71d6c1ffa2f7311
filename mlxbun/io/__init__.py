"""Artifact I/O: safetensors reading, sharded writing and atomic file publication."""
