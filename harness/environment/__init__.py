"""The environment: its record and key, kernel invariance, compile checks, probes."""
