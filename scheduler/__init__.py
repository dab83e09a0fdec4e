"""The scheduler: requests, KV block management, prefix caching and continuous batching.

Pure Python + numpy; it never imports jax (tests/test_no_jax_in_scheduler.py enforces it).
"""

from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import ComputedBlocks, KVCacheManager, KVUsage
from scheduler.outputs import (
    DraftCandidate,
    NewRequestData,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.stats import SchedulerStats
from scheduler.structured_params import GrammarHandle, StructuredOutputsParams

__all__ = [
    "DraftCandidate",
    "ComputedBlocks",
    "FinishReason",
    "KVCacheManager",
    "KVUsage",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "ScheduledRequest",
    "GrammarHandle",
    "StructuredOutputsParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
