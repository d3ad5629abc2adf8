"""Comparisons: run A against run B (or two environment keys), refusing unlike runs; per-stack
changes, the kernel and bench inputs, the document."""
