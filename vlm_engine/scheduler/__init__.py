"""Request lifecycle and batching policy; knows pages and tokens, never tensors."""

from vlm_engine.scheduler.request import Request, RequestStatus
from vlm_engine.scheduler.scheduler import (
    RequestRejected,
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = [
    "Request",
    "RequestRejected",
    "RequestStatus",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]

