"""bench.gather_wheels: which distributions a GPU machine with no network is sent."""

from __future__ import annotations

from pathlib import Path

from bench.gather_wheels import IMAGE, core_requirements, needed, requirement_name


def test_markers_for_another_platform_or_an_extra_leave_a_requirement_out():
    assert requirement_name("pydantic_core==2.1; python_version >= '3.9'") == "pydantic-core"
    assert requirement_name("httpx2-jsfetch; sys_platform == 'emscripten'") is None
    assert requirement_name('opentelemetry-sdk>=1.4; extra == "standard"') is None
    assert requirement_name("typing-extensions>=4; python_version < '3.11'") is None


def test_the_walk_stops_at_what_the_image_has():
    pins = needed(core_requirements(Path(__file__).parents[2] / "pyproject.toml"), IMAGE)
    # the server and its own requirements travel; jax, torch and what they bring do not
    assert {"fastapi", "starlette", "pydantic", "pydantic-core", "uvicorn"} <= pins.keys()
    assert {"llguidance", "gguf", "partial-json-parser"} <= pins.keys()
    assert not pins.keys() & {"jax", "jaxlib", "flax", "numpy", "torch", "transformers"}
    assert not pins.keys() & {"anyio", "h11", "click", "pyyaml"}  # in the image
