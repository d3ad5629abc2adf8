"""The batch-invariant mode under the name it had before the kernels moved into rooms
(`kvfid.kernels.mode`); it lives in kvfid.kernels.invariant.mode."""

from kvfid.kernels.invariant.mode import set_batch_invariant_mode

__all__ = ["set_batch_invariant_mode"]
