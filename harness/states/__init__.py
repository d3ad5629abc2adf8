"""Layer states at a boundary: read from and put back into transformers' caches, fingerprinted,
compared bit by bit, and cut for transplants."""
