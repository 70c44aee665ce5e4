"""LoRA adapters in the OpenAI server: which adapter a request's ``model`` names.

- ``--lora-modules``: adapters added to the engine at start-up, before the socket
  opens (a bad one stops the start-up with its error).
- `ServingModels`: the names a request may address (the base model's served names,
  which run without an adapter, and every adapter's name) and `/v1/models`' cards.
- ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes and
  answers), only with ``--enable-lora`` and ``$JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING``
  (or vLLM's ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING``) set to 1 or true.

Adapter ids are 1, 2, ... in the order adapters are added, and never reused: an id
the engine has seen (even for an adapter that failed to load, or was unloaded) may
still key its host caches, so a new adapter always gets a new one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from jaxengine.lora import LoRAAdapterNotFoundError, LoRARequest
from server.errors import APIError

logger = logging.getLogger("jaxengine.server")

RUNTIME_UPDATING_ENV = ("JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` value: an adapter's name, PEFT folder and parent name."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``
    (vLLM's two forms); argparse's type for ``--lora-modules``."""
    text = text.strip()
    if text.startswith("{"):
        return _module_from_json(text)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"--lora-modules {text!r}: give name=path or a JSON object with name and path"
        )
    return LoRAModulePath(name.strip(), path.strip())


def _module_from_json(text: str) -> LoRAModulePath:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: invalid JSON ({e})") from None
    fields = {f.name for f in dataclasses.fields(LoRAModulePath)}
    unknown = sorted(set(value) - fields) if isinstance(value, dict) else []
    if unknown:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: unknown fields {unknown}")
    if not isinstance(value, dict) or not all(
        isinstance(value.get(k), str) and value[k] for k in ("name", "path")
    ):
        raise argparse.ArgumentTypeError(
            f"--lora-modules {text!r}: a JSON object needs string fields name and path"
        )
    base = value.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: base_model_name: a string")
    return LoRAModulePath(value["name"], value["path"], base)


def check_lora_modules(modules: Sequence[LoRAModulePath], enable_lora: bool) -> None:
    """ValueError for ``--lora-modules`` without ``--enable-lora``, or a name twice."""
    if not modules:
        return
    if not enable_lora:
        raise ValueError("--lora-modules requires --enable-lora")
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules: the name(s) {twice} are given more than once")


def runtime_updating_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the load/unload routes are on (either variable is "1" or "true")."""
    return any(
        environ.get(name, "0").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENV
    )


class LoadLoRAAdapterRequest(BaseModel):
    """The body of ``POST /v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """The body of ``POST /v1/unload_lora_adapter`` (``lora_int_id``, if given, must
    be the adapter's id)."""

    lora_name: str
    lora_int_id: int | None = None


class ServingModels:
    """The model names a request may address, and the adapters behind them.

    Invariants: an adapter's name is never a served name of the base model nor
    another adapter's; a name is listed only once `engine.add_lora` has accepted
    the adapter, and stops resolving before `engine.remove_lora` is called (a request
    that resolved it earlier may still finish with it). Loads and unloads are
    serialized by one lock; resolving never waits.
    """

    def __init__(self, engine: Any, base_names: Sequence[str]) -> None:
        if not base_names:
            raise ValueError("at least one served model name is needed")
        self.engine = engine
        self.base_names = tuple(base_names)
        self.loras: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()

    def resolve(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(the name to echo, its adapter or None for the base model); 404 for an
        unknown name. No name addresses the first served name."""
        if not name:
            return self.base_names[0], None
        if name in self.base_names:
            return name, None
        lora = self.loras.get(name)
        if lora is None:
            raise APIError(f"The model `{name}` does not exist.", 404, "model")
        return name, lora

    def cards(self) -> list[dict[str, Any]]:
        """`/v1/models`' entries: the served names, then the adapters (vLLM's
        ModelCard: an adapter's ``root`` is its folder, its ``parent`` its base)."""
        root = self.engine.config.model_config.model
        cards = [self._card(name, root, None) for name in self.base_names]
        for lora in self.loras.values():
            parent = lora.base_model_name or self.base_names[0]
            cards.append(self._card(lora.lora_name, lora.lora_path, parent))
        return cards

    def _card(self, name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxengine",
            "root": root,
            "parent": parent,
            "max_model_len": self.engine.max_model_len,
        }

    async def add_static(self, modules: Sequence[LoRAModulePath]) -> None:
        """Adds the ``--lora-modules`` adapters in order (ids 1, 2, ...); raises
        ValueError naming the module that cannot be served."""
        for module in modules:
            where = f"--lora-modules {module.name}={module.path}"
            if module.name in self.base_names:
                raise ValueError(f"{where}: the name is a served model name")
            if module.name in self.loras:
                raise ValueError(f"{where}: the name is given more than once")
            try:
                await self._add(module.name, module.path, module.base_model_name)
            except ValueError as e:  # LoRAAdapterError among them
                raise ValueError(f"{where}: {e}") from e
            logger.info("Loaded LoRA adapter %r from %s", module.name, module.path)

    async def _add(self, name: str, path: str, base_model_name: str | None) -> None:
        lora = LoRARequest(name, self._next_id, path, base_model_name)
        self._next_id += 1  # spent even if the engine refuses the adapter
        await self.engine.add_lora(lora)
        self.loras[name] = lora

    async def load(self, request: LoadLoRAAdapterRequest) -> str:
        """``/v1/load_lora_adapter``: vLLM's success text; APIError 400 for a missing
        field, a name already in use, or an adapter the engine refuses, 404 (vLLM's
        NotFoundError) for a path with no adapter (no ``adapter_config.json``)."""
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.")
        async with self._lock:
            if name in self.loras:
                raise APIError(f"The lora adapter '{name}' has already been loaded.")
            if name in self.base_names:
                raise APIError(f"The lora adapter '{name}' has the name of a served model.")
            try:
                await self._add(name, path, None)
            except LoRAAdapterNotFoundError as e:
                raise APIError(str(e), 404) from e
            except ValueError as e:  # LoRAAdapterError: the adapter's problem
                raise APIError(str(e), 400) from e
        logger.info("Loaded new LoRA adapter: name %r, path %r", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        """``/v1/unload_lora_adapter``: vLLM's success text; APIError 404 for an
        unknown name, 400 for a missing name or an ``lora_int_id`` that is not its id."""
        name = request.lora_name
        if not name:
            raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            lora = self.loras.get(name)
            if lora is None:
                raise APIError(f"The lora adapter '{name}' cannot be found.", 404)
            if request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id:
                raise APIError(
                    f"The lora adapter '{name}' has id {lora.lora_int_id}, "
                    f"not {request.lora_int_id}.",
                    param="lora_int_id",
                )
            del self.loras[name]  # new requests stop resolving it first
            await self.engine.remove_lora(lora.lora_int_id)
        logger.info("Removed LoRA adapter: name %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."


def add_lora_routes(app: FastAPI, models: ServingModels) -> None:
    """The runtime load/unload routes (the caller decides whether they are on)."""
    logger.warning(
        "LoRA dynamic loading & unloading is enabled in the API server. "
        "This should ONLY be used for local development!"
    )

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        return PlainTextResponse(await models.load(request))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await models.unload(request))
