"""Paged attention: the backend contract, a torch reference, and a fused CPU op."""
