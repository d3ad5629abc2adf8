"""Runs: cases, the matrix of units, the ledger, aggregates and audits."""
