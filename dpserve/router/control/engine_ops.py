"""vLLM endpoints that act on one replica's engine (adapters, sleep, caches, profiling): admin-only.

They change what a replica holds or does for every client, so they are not user endpoints: a user key
gets 404 for `/sleep` at the router, as for any unknown path. The admin API sends them to one replica
(`/admin/replicas/{id}/engine/{op}`) or to every replica (`/admin/engine/{op}`), with the body and
query string as given, and returns each replica's answer.
"""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from dpserve.replicas.registry import Replica
from dpserve.router.http.errors import OpenAIError


@dataclass(frozen=True, slots=True)
class EngineOp:
    method: str
    path: str


ENGINE_OPS: dict[str, EngineOp] = {
    "load_lora_adapter": EngineOp("POST", "/v1/load_lora_adapter"),
    "unload_lora_adapter": EngineOp("POST", "/v1/unload_lora_adapter"),
    # The same in SageMaker's shape (served with runtime LoRA updating on): body {"name", "src"}; the
    # adapter to unload is the query's `adapter_name` (`?adapter_name=NAME`).
    "load_adapter": EngineOp("POST", "/adapters"),
    "unload_adapter": EngineOp("DELETE", "/adapters/{adapter_name}"),
    "sleep": EngineOp("POST", "/sleep"),
    "wake_up": EngineOp("POST", "/wake_up"),
    "is_sleeping": EngineOp("GET", "/is_sleeping"),
    "reset_prefix_cache": EngineOp("POST", "/reset_prefix_cache"),
    "reset_mm_cache": EngineOp("POST", "/reset_mm_cache"),
    "reset_encoder_cache": EngineOp("POST", "/reset_encoder_cache"),
    "start_profile": EngineOp("POST", "/start_profile"),
    "stop_profile": EngineOp("POST", "/stop_profile"),
    "server_info": EngineOp("GET", "/server_info"),
    "load": EngineOp("GET", "/load"),
    "pause": EngineOp("POST", "/pause"),
    "resume": EngineOp("POST", "/resume"),
    "is_paused": EngineOp("GET", "/is_paused"),
    "kv_event_sources": EngineOp("GET", "/kv_event_sources"),
    "scale_elastic_ep": EngineOp("POST", "/scale_elastic_ep"),
    "is_scaling_elastic_ep": EngineOp("POST", "/is_scaling_elastic_ep"),
    "collective_rpc": EngineOp("POST", "/collective_rpc"),
    "release_kv_cache_memory": EngineOp("POST", "/release_kv_cache_memory"),
    "fault_tolerance_status": EngineOp("GET", "/fault_tolerance/status"),
    "fault_tolerance_apply": EngineOp("POST", "/fault_tolerance/apply"),
    # Weight updates for reinforcement learning (vLLM's rl/online routes).
    "abort_requests": EngineOp("POST", "/abort_requests"),
    "get_world_size": EngineOp("GET", "/get_world_size"),
    "weight_info": EngineOp("GET", "/weight_info"),
    "init_weight_transfer_engine": EngineOp("POST", "/init_weight_transfer_engine"),
    "shutdown_weight_transfer_engine": EngineOp("POST", "/shutdown_weight_transfer_engine"),
    "start_weight_update": EngineOp("POST", "/start_weight_update"),
    "start_draft_weight_update": EngineOp("POST", "/start_draft_weight_update"),
    "update_weights": EngineOp("POST", "/update_weights"),
    "finish_weight_update": EngineOp("POST", "/finish_weight_update"),
    "update_weight_version": EngineOp("POST", "/update_weight_version"),
    "weight_checker": EngineOp("POST", "/weight_checker"),
}
ROUTER_OWN = frozenset({"/health", "/metrics", "/v1/models", "/ping", "/docs", "/openapi.json"})
"""vLLM paths the router does not relay: it answers them itself (SageMaker's /ping is a replica's own probe)."""


def engine_op(name: str, method: str) -> EngineOp:
    op = ENGINE_OPS.get(name)
    if op is None:
        known = ", ".join(sorted(ENGINE_OPS))
        raise OpenAIError(404, f"No engine operation `{name}`; known: {known}.", type="not_found_error")
    if op.method != method:
        raise OpenAIError(405, f"Engine operation `{name}` takes {op.method}.", headers={"allow": op.method})
    return op


def fill_path(op: EngineOp, query: str) -> tuple[str, str]:
    """The op's path with its `{name}` parts taken from the query string (a 400 when one is missing),
    and what is left of the query."""
    if "{" not in op.path:
        return op.path, query
    params = urllib.parse.parse_qsl(query, keep_blank_values=True)
    path = op.path
    for name in re.findall(r"\{(\w+)\}", op.path):
        value = next((v for k, v in params if k == name), "")
        if not value:
            raise OpenAIError(400, f"This engine operation needs `?{name}=...`.", param=name)
        path = path.replace(f"{{{name}}}", urllib.parse.quote(value, safe=""))
        params = [(k, v) for k, v in params if k != name]
    return path, urllib.parse.urlencode(params)


async def call_engine(
    session: aiohttp.ClientSession,
    replicas: Sequence[Replica],
    op: EngineOp,
    query: str,
    body: bytes,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Each replica's answer: its id, HTTP status and body (JSON when it is), or the error reaching it."""

    path, query = fill_path(op, query)

    async def one(replica: Replica) -> dict[str, Any]:
        url = f"{replica.url}{path}" + (f"?{query}" if query else "")
        headers = {"content-type": "application/json"} if body else {}
        try:
            async with session.request(
                op.method, url, data=body or None, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return {"replica": replica.id, "status": None, "error": f"{type(exc).__name__}: {exc}"}
        try:
            answer: Any = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            answer = raw.decode("utf-8", "replace")
        return {"replica": replica.id, "status": status, "body": answer}

    return list(await asyncio.gather(*(one(replica) for replica in replicas)))
