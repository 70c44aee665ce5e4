"""Download the wheels a GPU machine with no network needs to run jaxengine.

The GPU machine's image already holds jax with its CUDA plugin, flax, transformers,
torch, numpy and the common packages (`IMAGE` below); what jaxengine needs beyond them
(the server's fastapi and uvicorn, llguidance, gguf, openai, ...) travels as wheels.
This walks jaxengine's core dependencies (pyproject's ``dependencies``) and their own
requirements through the distributions installed here, stops at what the image has,
and downloads each remaining one at the version installed here, for CPython 3.12 on
manylinux x86-64, without dependencies (pip resolves nothing there):

    python -m bench.gather_wheels              # into .whl/ (git-ignored), at most 64 MiB
    python -m bench.gather_wheels --list       # only print what would be downloaded

There, install them into a folder and put it on the path (bench/README.md, "On a GPU
machine with no network").
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

IMAGE = frozenset(
    """absl-py accelerate aiohttp anyio attrs certifi charset-normalizer click filelock
    flax fsspec h11 httpcore httpx huggingface-hub hypothesis idna iniconfig jax jaxlib
    jinja2 markupsafe ml-dtypes msgpack numpy opt-einsum optax orbax-checkpoint packaging
    peft pluggy prometheus-client protobuf psutil pytest pytest-xdist pyyaml regex
    requests rich safetensors scipy sentencepiece setuptools tensorstore tokenizers
    torch tqdm transformers typing-extensions urllib3 uvloop""".split()
)
"""Distributions the GPU machine's image has (jax 0.11 with the CUDA 13 plugin)."""

PLATFORMS = ("manylinux2014_x86_64",) + tuple(f"manylinux_2_{n}_x86_64" for n in range(17, 36))
"""pip matches a manylinux tag exactly: every glibc up to the GPU machine's 2.35."""
LIMIT_MIB = 64


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
"""The GPU machine, for the requirements' environment markers."""


def requirement_name(spec: str) -> str | None:
    """The distribution a requirement names, None for one its markers leave out there
    (behind an extra, another platform or Python)."""
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate(TARGET):
        return None
    return canonical(req.name)


def core_requirements(pyproject: Path) -> list[str]:
    with pyproject.open("rb") as f:
        return [n for n in map(requirement_name, tomllib.load(f)["project"]["dependencies"]) if n]


def needed(roots: list[str], have: frozenset[str]) -> dict[str, str]:
    """name -> version installed here of every distribution reachable from ``roots``
    that the image lacks."""
    found: dict[str, str] = {}
    todo = [r for r in roots if r not in have]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        dist = md.distribution(name)
        found[name] = dist.version
        for spec in dist.requires or []:
            child = requirement_name(spec)
            if child and child not in have and child not in found:
                todo.append(child)
    return dict(sorted(found.items()))


def download(pins: dict[str, str], dest: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in pins.items():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
            + ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
            + platforms
            + ["-d", str(dest), f"{name}=={version}"],
            check=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    parser.add_argument("--list", action="store_true", help="print the pins, download nothing")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    pins = needed(core_requirements(root / "pyproject.toml"), IMAGE)
    print(" ".join(f"{n}=={v}" for n, v in pins.items()))
    if args.list:
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    download(pins, args.dest)
    total = sum(p.stat().st_size for p in args.dest.glob("*.whl")) / 2**20
    print(f"{len(list(args.dest.glob('*.whl')))} wheels in {args.dest}: {total:.1f} MiB")
    if total > LIMIT_MIB:
        print(f"over the {LIMIT_MIB} MiB a GPU call carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
