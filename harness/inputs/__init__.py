"""What an item is made of: the models (presets and `hf:` folders, loaded as transformers loads
them), the item sets and the trajectories file."""
