"""Where models come from: a command's model (a directory, a registry name, an HF cache entry or a synthetic spec), what an HF cache holds, and a model directory's fingerprint."""
