"""Request lifecycle and batching policy; knows pages and tokens, never tensors."""

from vlm_engine.scheduler.batch import RequestRejected, ScheduledChunk, SchedulerConfig, SchedulerOutput, StepUpdate
from vlm_engine.scheduler.request import Request, RequestStatus, SampledToken
from vlm_engine.scheduler.scheduler import Scheduler

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
