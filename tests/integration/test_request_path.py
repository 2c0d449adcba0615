"""A streamed chat request walks the router one way: each step is entered only from the step before it,
its life's events come from the two that drive it, and it walks no more files than `docs/architecture.md`
says (traced with a profiler through a real router app in front of a `dpserve sim`, the request asking for
its receipt as a sampled one gets it)."""

from __future__ import annotations

import pytest

from benchmarks.request_path import trace_in_source

pytestmark = pytest.mark.integration

MOST_ROUTER_FILES = {"kv_aware": 19, "least_loaded": 18}
"""The router's own files (its rooms, `dpserve/router/`) one streamed chat request enters (`python -m
benchmarks.request_path`), as written down in docs/architecture.md: a new file on the path must be worth it,
and this number says so when it grows. The pure libraries it calls below (`policies/`, `kvindex/`) and the
registry's are not counted (issue [1/5]'s decision: what matters is each step entered once, checked above)."""


@pytest.mark.parametrize("policy", ["least_loaded", "kv_aware"])
def test_each_step_of_a_streamed_request_is_entered_only_from_the_step_before(policy: str) -> None:
    visits = trace_in_source(policy)  # the source, in a process of its own: a profiler sees no compiled code
    callers = {
        name.removeprefix("dpserve/"): [c.removeprefix("dpserve/") for c in found]
        for name, found in visits.callers.items()
    }
    assert callers["router/http/proxied_paths.py"] == ["router/flow/access.py"]
    assert callers["router/routing/proxied_endpoints.py"] == ["router/http/proxied_paths.py"]
    assert callers["router/http/request_body.py"] == ["router/routing/proxied_endpoints.py"]
    assert callers["router/routing/features.py"] == ["router/routing/proxied_endpoints.py"]
    assert callers["router/routing/selection.py"] == ["router/routing/dispatch.py"]
    assert callers["router/http/upstream_client.py"] == ["router/routing/dispatch.py"]
    # Its life is told what happens by the exchange and the dispatcher only; the features watch it.
    assert sorted(callers["router/observe/life.py"]) == [
        "router/routing/dispatch.py",
        "router/routing/proxied_endpoints.py",
    ]
    assert callers["router/routing/dispatch.py"] == ["router/routing/proxied_endpoints.py"]
    assert callers["router/quality/receipts.py"] == ["router/routing/proxied_endpoints.py", "router/observe/life.py"]
    router_files = [name for name in visits.order if name.startswith("dpserve/router/")]
    assert len(router_files) <= MOST_ROUTER_FILES[policy], router_files
    # The policy is asked by the selector alone.
    policy_file = f"policies/{policy}.py"
    assert callers[policy_file] == ["router/routing/selection.py"]
    if policy == "kv_aware":
        assert "router/observe/prompt_tokens.py" in callers and callers["router/observe/prompt_tokens.py"] == [
            "router/routing/features.py"
        ]
