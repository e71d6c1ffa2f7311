"""command=allocate: per-layer settings under a true size budget (plan.json), the knapsack it solves, the byte accounting, protection rules, the in-model interaction rounds and the check."""
