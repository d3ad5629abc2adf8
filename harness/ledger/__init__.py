"""The ledger: one SQLite file of runs, units and their records (checksummed), its opening and
migration, process leases, a record's rows, the engine checks."""
