"""vlm-engine: a small, readable inference engine for vision-language models."""

from vlm_engine.engine import Engine, RequestOutput
from vlm_engine.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
