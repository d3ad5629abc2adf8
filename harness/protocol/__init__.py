"""The fidelity protocol on one item and one stack: the arms, constructions, decoding, co-batches,
the serving engines' constructions, replicas, transplants and the crossing."""
