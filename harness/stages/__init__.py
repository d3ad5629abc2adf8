"""Stage programs: branches then a merge (packed under a visibility mask, or batched), their arms,
transplants and crossing at the merge boundary."""
