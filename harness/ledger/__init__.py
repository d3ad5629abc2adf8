"""The ledger: one SQLite file of runs, units and their records (checksummed), its opening and
migration, process leases, a record's rows, the engine checks."""

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on machines without CUDA)
