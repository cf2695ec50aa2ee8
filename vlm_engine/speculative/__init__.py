"""Speculative decoding: proposers (n-gram lookup, a draft model), verification inside the
ordinary batched forward pass, and the policy that decides when it pays."""

from vlm_engine.speculative.speculator import (
    Proposer,
    RequestSpeculation,
    SpeculationStats,
    Speculator,
    build_speculator,
)

__all__ = ["Proposer", "RequestSpeculation", "SpeculationStats", "Speculator", "build_speculator"]
