"""vlm-engine: a small, readable inference engine for vision-language models.

`Engine` and friends are imported lazily so that light processes (HTTP server, preprocessing
workers) and leaf modules can import `vlm_engine.<sub>` without loading the whole engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from vlm_engine.engine import Engine, RequestOutput
    from vlm_engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in ("Engine", "RequestOutput"):
        from vlm_engine import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from vlm_engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'vlm_engine' has no attribute {name!r}")
