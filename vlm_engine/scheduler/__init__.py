"""Request lifecycle and batching policy; knows pages and tokens, never tensors."""

from vlm_engine.scheduler.request import Request, RequestStatus, SampledToken
from vlm_engine.scheduler.scheduler import (
    RequestRejected,
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepUpdate,
)

__all__ = [
    "Request",
    "RequestRejected",
    "RequestStatus",
    "SampledToken",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepUpdate",
]

