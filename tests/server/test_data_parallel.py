"""Every data-parallel replica takes load: `/metrics` counts requests for each engine.

Runs against each server of the suite (``--data-parallel-size`` 1 and 2): after a
burst of concurrent requests, every ``engine="i"`` label has finished requests and
processed tokens, and no other engine label exists.
"""

from __future__ import annotations

import asyncio
import re

from tests.server.conftest import MODEL
from tests.server.test_endpoints import wait_for

SUCCESS = "jaxengine:request_success_total"
PROMPT_TOKENS = "jaxengine:prompt_tokens_total"


def per_engine(samples: dict[str, float], name: str) -> dict[str, float]:
    """{engine index: value summed over the other labels} of one metric."""
    totals: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', key).group(1)
            totals[engine] = totals.get(engine, 0.0) + value
    return totals


def test_every_replica_serves_concurrent_requests(server):
    before = server.metrics(per_engine=True)
    client = server.async_client(max_retries=0, timeout=120)

    async def burst():
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL, prompt=f"Request {i}: count to", max_tokens=3, temperature=0
                )
                for i in range(4 * server.data_parallel_size)
            )
        )

    outs = asyncio.run(burst())
    assert all(out.usage.completion_tokens >= 1 for out in outs)
    engines = [str(i) for i in range(server.data_parallel_size)]

    def finished() -> dict[str, float]:
        after = per_engine(server.metrics(per_engine=True), SUCCESS)
        old = per_engine(before, SUCCESS)
        return {e: after.get(e, 0.0) - old.get(e, 0.0) for e in after}

    assert wait_for(lambda: sum(finished().values()) == len(outs))
    assert sorted(finished()) == engines
    assert all(count > 0 for count in finished().values()), finished()
    tokens = per_engine(server.metrics(per_engine=True), PROMPT_TOKENS)
    assert sorted(tokens) == engines and all(v > 0 for v in tokens.values()), tokens
