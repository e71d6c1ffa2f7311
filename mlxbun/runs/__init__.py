"""Runs: what every run records (manifest.json, the RunRecord), and the runs and verify commands that read it back."""
