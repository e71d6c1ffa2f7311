"""command=sensitivity and sensitivity_merge: each module's KL at candidate settings, measured (exact, reference) or estimated (fisher), and the sensitivity.json file."""
