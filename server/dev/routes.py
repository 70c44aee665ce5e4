"""vLLM's development routes: what an RL trainer calls on its rollout server.

On with ``$VLLM_SERVER_DEV_MODE=1`` (any client can take the engine down with them):

- ``POST /sleep?level=1|2``, ``POST /wake_up?tags=weights&tags=kv_cache``,
  ``GET /is_sleeping``: sleep mode (``--enable-sleep-mode``; `engine.rollout`);
- ``POST /reset_prefix_cache``;
- ``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``GET /is_paused``
  (`entrypoints.pausing`);
- ``POST /collective_rpc`` ``{"method", "args", "kwargs"}``: any of the engine's
  rollout calls by name, ``{"results": [one per replica]}``;
- ``POST /update_weights`` ``{"path": "..."}``: a trainer in another process saves its
  weights as a checkpoint (same architecture) and the engine reads them in
  (`LLM.reload_weights`); without ``path``, the served checkpoint again.

A call that needs an idle or paused engine while requests run answers 409, a bad
argument or a checkpoint that does not fit 400. ``/health`` answers while the engine
sleeps; a generation request then answers 503 (`server.api_server.app`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query, Response
from pydantic import BaseModel

from jaxengine.entrypoints.client import EngineClient
from server.errors import APIError


class CollectiveRPCRequest(BaseModel):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None  # accepted for vLLM's clients; calls run to the end


class UpdateWeightsRequest(BaseModel):
    path: str | None = None


async def _rpc(
    engine: EngineClient, method: str, *args: Any, kwargs: dict[str, Any] | None = None
) -> list[Any]:
    try:
        return await engine.collective_rpc(method, args, kwargs)
    except RuntimeError as e:  # requests running, weights asleep
        raise APIError(str(e), 409) from e
    except NotImplementedError as e:
        raise APIError(str(e), 400) from e


def add_dev_routes(app: FastAPI, engine: EngineClient) -> None:
    """The routes above, on ``engine``."""

    @app.post("/sleep")
    async def sleep(level: int = 1):
        await _rpc(engine, "sleep", level)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):  # noqa: B008 - FastAPI's idiom
        await _rpc(engine, "wake_up", tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.is_sleeping}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await _rpc(engine, "reset_prefix_cache")
        return Response(status_code=200)

    @app.post("/pause")
    async def pause(mode: str = "abort"):
        await engine.pause_generation(mode)
        return Response(status_code=200)

    @app.post("/resume")
    async def resume():
        await engine.resume_generation()
        return Response(status_code=200)

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": await engine.is_paused()}

    @app.post("/collective_rpc")
    async def collective_rpc(request: CollectiveRPCRequest):
        results = await _rpc(engine, request.method, *request.args, kwargs=request.kwargs)
        return {"results": results}

    @app.post("/update_weights")
    async def update_weights(request: UpdateWeightsRequest):
        changed = await _rpc(engine, "reload_weights", request.path)
        return {"updated": changed}
