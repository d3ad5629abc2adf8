"""Tasks: what a command runs end to end (a run and its report, bench, the ledger views, kernels,
compare, gpu-check)."""
