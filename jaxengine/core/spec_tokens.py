"""What the scheduler does after a step that verified proposals (speculative
decoding): take back the rejected ones and count the acceptances. The proposing and
the acceptance rule live in `jaxengine.speculative`; this is the scheduler's side."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxengine.core.sched_output import RunnerOutput, SchedulerOutput, SpecDecodingStats


def take_back_rejected(
    requests: Mapping[str, Any], out: SchedulerOutput, ro: RunnerOutput, stats: SpecDecodingStats
) -> SpecDecodingStats:
    """The scheduler's side of a verified step: moves each request's computed count
    back over its rejected proposals (the runner returned the accepted ones and one
    more), so the prefix cache only publishes accepted tokens; returns ``stats`` with
    the step's proposals and acceptances counted."""
    if not out.scheduled_spec_decode_tokens:
        return stats
    sampled = dict(zip(ro.req_ids, ro.sampled_token_ids, strict=True))
    for rid, drafts in out.scheduled_spec_decode_tokens.items():
        req = requests.get(rid)
        if req is None:  # finished or aborted since it was scheduled
            continue
        accepted = max(len(sampled.get(rid, ())) - 1, 0)
        req.num_computed_tokens -= len(drafts) - accepted
        req.spec_token_ids = []
        stats = stats.observe(len(drafts), accepted)
    return stats
