"""A streamed chat request walks the router one way: each step is entered only from the step before it
(traced with a profiler through a real router app in front of a `dpserve sim`)."""

from __future__ import annotations

import pytest

from benchmarks.request_path import trace_one_request

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("policy", ["least_loaded", "kv_aware"])
async def test_each_step_of_a_streamed_request_is_entered_only_from_the_step_before(policy: str) -> None:
    visits = await trace_one_request(policy)
    callers = {
        name.removeprefix("dpserve/"): [c.removeprefix("dpserve/") for c in found]
        for name, found in visits.callers.items()
    }
    assert callers["router/proxied_paths.py"] == ["router/access.py"]
    assert callers["router/proxied_endpoints.py"] == ["router/proxied_paths.py"]
    assert callers["router/request_body.py"] == ["router/proxied_endpoints.py"]
    assert callers["router/features.py"] == ["router/proxied_endpoints.py"]
    assert callers["router/selection.py"] == ["router/dispatch.py"]
    assert callers["router/upstream_client.py"] == ["router/dispatch.py"]
    # The policy is asked by the selector alone.
    policy_file = f"policies/{policy}.py"
    assert callers[policy_file] == ["router/selection.py"]
    if policy == "kv_aware":
        assert "router/prompt_tokens.py" in callers and callers["router/prompt_tokens.py"] == ["router/features.py"]
