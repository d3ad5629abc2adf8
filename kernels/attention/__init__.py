"""The attention kernels: the Triton kernel and the native (torch) path on one tiling contract,
beside the plain-PyTorch reference; masks and views."""
