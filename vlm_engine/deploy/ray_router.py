"""Ray Serve's prefix-affinity request router with our key (`routing.routing_key`: text and media
content hashes in prompt order) and replica pins. Named by import path in the deployment's
`RequestRouterConfig`, so Serve can build it wherever a handle routes."""

from __future__ import annotations

from typing import Any

# The public alias (ray.serve.llm.request_router) imports Ray's vLLM/SGLang protocol models, which
# need one of those engines installed; the class itself needs neither.
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

from vlm_engine.deploy.routing import key_of, pinned_replica


class MediaPrefixAffinityRouter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request: Any) -> str:
        return key_of(pending_request)

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[Any]:
        pinned = pinned_replica(pending_request)
        if pinned is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.to_full_id_str() == pinned]
            if chosen:
                return [chosen]
        return await super().choose_replicas(candidate_replicas, pending_request)
