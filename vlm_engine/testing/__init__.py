"""Test/benchmark helpers: deterministic offline checkpoints (see `checkpoints`)."""
