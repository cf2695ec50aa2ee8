"""Test and benchmark helpers, outside the wheel: deterministic offline checkpoints (see `checkpoints`),
videos and JSON schemas. Nothing the engine runs imports them."""
