"""What `blame` reads: every aten op of a forward with its module, the slices at the blamed
position, and how a stepped recurrence aligns."""
