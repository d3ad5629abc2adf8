"""The diagnoses on one item: repro (and of a stage program), replay of an engine's trajectories,
re-scoring, blame, and their printing."""
