"""Checkpoints quantized by their publishers (AWQ, GPTQ, compressed-tensors), read as stored: base.py is the
contract between a format's reader and the loader."""
