"""Vision: jaxengine's image encoder and image-prompt TTFT against transformers, one run.

    python -m bench.vision                      # a random SmolVLM (bench.tiny_vlm.BENCH)
    python -m bench.vision --model FOLDER       # a SmolVLM folder of your own
    python -m bench.vision --quick              # tiny sizes, few images (the test)

Both peers load the same folder (without ``--model``: a random SmolVLM of the size
flags, written to a temporary folder by `bench.tiny_vlm`) and see the same images:
random RGB noise of ``--image-px`` pixels a side (default: the processor's
``longest_edge``, so each image takes the most tiles), a distinct image per draw.

- **encoder images/s**: the encoder alone on the same processed tiles (transformers'
  processor ran once per image beforehand, outside the clock). jaxengine: the
  engine's own encoder step, `runner.encoder.EncoderRunner` around
  `models.idefics3.Idefics3ImageEncoder` with the folder's encoder weights, its unit
  buckets compiled ahead; one compiled call per image as the engine makes them,
  dispatched back to back, the clock stopped when the last rows are ready.
  transformers: ``model.model.get_image_features(pixel_values, pixel_attention_mask)``
  per image (all its tiles at once), float32, eager, ``torch.inference_mode``. Each
  round is one pass over ``--images`` images per peer, alternating; the ratio is per
  round, then averaged. The first image's features are compared (max |diff| over
  max |value|).
- **image-prompt TTFT s**: one chat prompt with one image (a fresh image each time,
  so neither the encoder cache nor the prefix cache can help; the table shows the
  prompt tokens jaxengine found cached), one token. jaxengine:
  ``LLM.generate([{"prompt", "multi_modal_data"}], max_tokens=1)``, processor and
  detokenizer included; transformers: processor, then ``generate(max_new_tokens=1)``.
  Median of ``--repeats``, the peers alternating, after two warm-up prompts each.

torch runs on ``--threads`` threads with denormals flushed to zero (as XLA's CPU
runtime does). Loading (and jaxengine's compilation) is timed apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np

from bench import tiny_vlm
from jaxengine.benchmarks.common import (
    default_threads,
    describe_run,
    fmt,
    format_table,
    log,
    machine_info,
    parse_engine_kwargs,
    positive_int,
)

SIZE_FLAGS = tuple(f.name for f in dataclasses.fields(tiny_vlm.VlmSize))
COUNTS = {"images": (32, 4), "rounds": (3, 1), "repeats": (10, 3)}
"""Defaults of the count flags: (full run, --quick)."""
QUICK_ENGINE = {"max_model_len": 256, "max_num_seqs": 2, "max_num_batched_tokens": 64,
                "compile_token_buckets": [64]}  # fmt: skip
"""--quick's engine arguments (under --engine-kwargs): one step bucket to compile."""
QUESTION = "Describe this image in one sentence."


def random_images(count: int, px: int, seed: int) -> list[Any]:
    """``count`` distinct ``px`` x ``px`` RGB noise images (seeds ``seed``, ``seed + 1``...)."""
    from PIL import Image

    return [
        Image.fromarray(np.random.default_rng(seed + i).integers(0, 256, (px, px, 3), np.uint8))
        for i in range(count)
    ]


def tiles_of(processor: Any, image: Any) -> dict[str, np.ndarray]:
    """One image's tiles as the processor makes them: ``pixel_values`` [T, C, S, S]
    float32, ``pixel_attention_mask`` [T, S, S] bool."""
    out = processor(text=["<image>"], images=[[image]], return_tensors="np")
    pixels = out["pixel_values"][0].astype(np.float32)
    masks = out.get("pixel_attention_mask", np.ones((1, *pixels.shape[:1], *pixels.shape[2:])))
    return {"pixel_values": pixels, "pixel_attention_mask": masks[0].astype(bool)}


class EngineEncoder:
    """The engine's encoder step alone (see module doc), in the engine's dtype."""

    def __init__(self, folder: str, dtype_flag: str) -> None:
        import jax
        import transformers

        from jaxengine.core.sched_output import EncoderInput
        from jaxengine.loader import cpu_dtypes, resolve_dtype
        from jaxengine.loader.encoder_params import load_module_params
        from jaxengine.loader.safetensors_io import iter_safetensors
        from jaxengine.models.idefics3 import Idefics3ImageEncoder
        from jaxengine.multimodal.idefics3 import max_units
        from jaxengine.runner.encoder import EncoderRunner

        hf_config = transformers.AutoConfig.from_pretrained(folder)
        backend = jax.default_backend()
        self.dtype, _ = cpu_dtypes(resolve_dtype(dtype_flag, hf_config, backend), backend)
        encoder = Idefics3ImageEncoder(hf_config, self.dtype)
        inputs = encoder.example_inputs()
        params = load_module_params(encoder.module, inputs, iter_safetensors(folder), folder)
        units = max_units(transformers.AutoProcessor.from_pretrained(folder))
        rows = units * encoder.embeds_per_unit  # one largest image
        self.runner = EncoderRunner(encoder, params, rows, units, self.dtype)
        for _, job in self.runner.compile_jobs():
            job()
        self._item = EncoderInput

    def encode(self, images: list[dict[str, np.ndarray]]) -> None:
        """Encodes each image (one compiled call each), waiting for the last."""
        per_unit = self.runner.encoder.embeds_per_unit
        items = []
        for i, tiles in enumerate(images):
            units = len(tiles["pixel_values"])
            items.append(self._item(str(i), tiles, units, tuple(range(units * per_unit))))
        self.runner.run(items, ensure=lambda key: None)  # every bucket compiled above
        self.runner.images.block_until_ready()

    def features(self, tiles: dict[str, np.ndarray]) -> np.ndarray:
        self.encode([tiles])
        rows = len(tiles["pixel_values"]) * self.runner.encoder.embeds_per_unit
        return np.asarray(self.runner.images[:rows], np.float32)


class HfModel:
    """transformers' SmolVLM on CPU in float32: the encoder and ``generate``."""

    def __init__(self, folder: str, threads: int) -> None:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
        self.torch = torch
        self.processor = transformers.AutoProcessor.from_pretrained(folder)
        model = transformers.Idefics3ForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32
        )
        self.model = model.eval()
        pad = self.processor.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.processor.tokenizer.eos_token_id

    def _tensors(self, tiles: dict[str, np.ndarray]) -> tuple:
        torch = self.torch
        return (torch.from_numpy(tiles["pixel_values"])[None],
                torch.from_numpy(tiles["pixel_attention_mask"])[None])  # fmt: skip

    def encode(self, images: list[dict[str, np.ndarray]]) -> None:
        batches = [self._tensors(t) for t in images]
        with self.torch.inference_mode():
            for pixels, masks in batches:
                self.model.model.get_image_features(pixels, masks)

    def features(self, tiles: dict[str, np.ndarray]) -> np.ndarray:
        with self.torch.inference_mode():
            out = self.model.model.get_image_features(*self._tensors(tiles))
        return out.pooler_output[0].float().numpy()

    def first_token(self, text: str, image: Any) -> int:
        inputs = self.processor(text=[text], images=[[image]], return_tensors="pt")
        with self.torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=1, do_sample=False,
                                      pad_token_id=self.pad)  # fmt: skip
        return int(out[0, -1])


def measure_encoder(ours: EngineEncoder, hf: HfModel, tiles: list[dict], rounds: int) -> dict:
    """images/s per round for each peer (alternating), after a warm-up pass of 2 images."""
    peers = {"jaxengine": ours.encode, "transformers": hf.encode}
    for encode in peers.values():
        encode(tiles[:2])
    speeds: dict[str, list[float]] = {name: [] for name in peers}
    for r in range(rounds):
        for name, encode in peers.items():
            start = perf_counter()
            encode(tiles)
            speeds[name].append(len(tiles) / (perf_counter() - start))
            log(f"encoder round {r} {name}: {speeds[name][-1]:.1f} images/s")
    a, b = ours.features(tiles[0]), hf.features(tiles[0])
    diff = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    return {"images_per_s": speeds, "max_rel_diff": diff, "tiles": len(tiles[0]["pixel_values"])}


def measure_ttft(llm: Any, hf: HfModel, text: str, images: list, warmup: int) -> dict:
    """Seconds to the first token per repeat for each peer (alternating); the first
    ``warmup`` images warm both up and are not timed."""
    from jaxengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    seconds: dict[str, list[float]] = {"jaxengine": [], "transformers": []}
    same, cached, prompt_len = 0, 0, 0
    for i, image in enumerate(images):
        start = perf_counter()
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": [image]}}], params,
                           use_tqdm=False)[0]  # fmt: skip
        ours = perf_counter() - start
        start = perf_counter()
        token = hf.first_token(text, image)
        theirs = perf_counter() - start
        if i < warmup:
            continue
        seconds["jaxengine"].append(ours)
        seconds["transformers"].append(theirs)
        same += int(list(out.outputs[0].token_ids) == [token])
        cached += out.num_cached_tokens or 0
        prompt_len = len(out.prompt_token_ids)
        log(f"TTFT repeat {i - warmup}: jaxengine {ours:.4f} s, transformers {theirs:.4f} s")
    return {"seconds": seconds, "same_first_token": same, "cached_tokens": cached,
            "prompt_tokens": prompt_len}  # fmt: skip


def run(args: argparse.Namespace, command: str) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as tmp:
        folder = args.model
        if folder is None:
            folder = str(Path(tmp) / "smolvlm")
            tiny_vlm.save_random_smolvlm(Path(folder), args.size)
        return measure(args, command, folder)


def measure(args: argparse.Namespace, command: str, folder: str) -> int:
    from jaxengine import LLM

    loads = {}
    start = perf_counter()
    hf = HfModel(folder, args.threads)
    loads["transformers"] = perf_counter() - start
    start = perf_counter()
    llm = LLM(model=folder, dtype=args.dtype, **args.engine_kwargs)
    loads["jaxengine LLM"] = perf_counter() - start
    start = perf_counter()
    ours = EngineEncoder(folder, args.dtype)
    loads["jaxengine encoder"] = perf_counter() - start
    px = args.image_px or int(hf.processor.image_processor.size["longest_edge"])
    tiles = [tiles_of(hf.processor, im) for im in random_images(args.images, px, seed=0)]
    encoder = measure_encoder(ours, hf, tiles, args.rounds)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": content}]
    text = hf.processor.apply_chat_template(messages, add_generation_prompt=True)
    fresh = random_images(args.repeats + 2, px, seed=args.images)  # none seen before
    ttft = measure_ttft(llm, hf, text, fresh, warmup=2)
    compiles = llm.engine.executor.compiles_after_warmup
    llm.shutdown()
    results = {"encoder": encoder, "ttft": ttft, "load_s": loads, "compiles_after_warmup": compiles,
               "image_px": px, "dtype": str(np.dtype(ours.dtype))}  # fmt: skip
    report(args, command, results)
    return 0


def table_rows(results: dict) -> list[list[str]]:
    """The encoder and TTFT rows: each peer's figure and jaxengine's speed-up."""
    enc, ttft = results["encoder"], results["ttft"]
    ours, theirs = enc["images_per_s"]["jaxengine"], enc["images_per_s"]["transformers"]
    ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
    enc_note = (f"{enc['tiles']} tiles/image, {len(ratios)} round(s), features max rel diff "
                f"{enc['max_rel_diff']:.1e}")  # fmt: skip
    median = {name: statistics.median(v) for name, v in ttft["seconds"].items()}
    n = len(ttft["seconds"]["jaxengine"])
    same, cached = ttft["same_first_token"], ttft["cached_tokens"]
    ttft_note = (f"{ttft['prompt_tokens']} prompt tokens, median of {n}, same first token "
                 f"{same}/{n}, cached tokens {cached}")  # fmt: skip
    return [
        ["encoder images/s", fmt(statistics.mean(ours), 1), fmt(statistics.mean(theirs), 1),
         f"{statistics.mean(ratios):.2f}x", enc_note],
        ["image-prompt TTFT s", fmt(median["jaxengine"], 4), fmt(median["transformers"], 4),
         f"{median['transformers'] / median['jaxengine']:.2f}x", ttft_note],
    ]  # fmt: skip


def report(args: argparse.Namespace, command: str, results: dict) -> None:
    workload = {"model": args.model or f"random SmolVLM {dataclasses.asdict(args.size)}",
                "image_px": results["image_px"], "images": args.images, "rounds": args.rounds,
                "repeats": args.repeats, "dtype": results["dtype"], "threads": args.threads,
                "engine_kwargs": args.engine_kwargs}  # fmt: skip
    print(describe_run("vision: image encoder and image-prompt TTFT", machine_info(), workload))
    header = ["measure", "jaxengine", "transformers", "jaxengine speed-up", "notes"]
    print(format_table(header, table_rows(results)))
    print("speed-up: jaxengine images/s over transformers', transformers' TTFT over jaxengine's")
    print("load s (not in the figures): " + ", ".join(
        f"{k} {v:.1f}" for k, v in results["load_s"].items()))  # fmt: skip
    print(f"compilations after warm-up: {results['compiles_after_warmup']}")
    if args.json:
        doc = {"benchmark": "vision", "command": command, "machine": machine_info(),
               "workload": workload, "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="a SmolVLM (Idefics3) folder; default: a random one of the size "
                   "flags")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="the tests' tiny model, few images and one compiled step bucket "
                   f"{QUICK_ENGINE} (size, count and engine flags given still apply)")  # fmt: skip
    for name in SIZE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=positive_int, default=None,
                       help=f"random model: {name} (default {getattr(tiny_vlm.BENCH, name)}; "
                       f"--quick {getattr(tiny_vlm.QUICK, name)})")  # fmt: skip
    for name, (full, quick) in COUNTS.items():
        p.add_argument("--" + name, type=positive_int, default=None,
                       help=f"default {full}; --quick {quick}")  # fmt: skip
    p.add_argument("--image-px", type=positive_int, default=None,
                   help="pixels a side of the images (default: the processor's "
                   "longest_edge)")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="jaxengine's --dtype (transformers: float32)")
    p.add_argument("--threads", type=positive_int, default=default_threads(),
                   help="torch threads (default: cores available, %(default)s)")  # fmt: skip
    p.add_argument("--engine-kwargs", type=parse_engine_kwargs, default={},
                   help="JSON object of LLM(...) arguments")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with the sizes (``args.size``) and counts the run uses filled in."""
    args = build_parser().parse_args(argv)
    base = tiny_vlm.QUICK if args.quick else tiny_vlm.BENCH
    given = {n: getattr(args, n) for n in SIZE_FLAGS if getattr(args, n) is not None}
    if args.model is not None and given:
        raise SystemExit("the size flags describe the random model: not with --model")
    args.size = dataclasses.replace(base, **given)
    for name, (full, quick) in COUNTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.quick:
        args.engine_kwargs = {**QUICK_ENGINE, **args.engine_kwargs}
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return run(args, "python -m bench.vision " + shlex.join(argv))


if __name__ == "__main__":
    raise SystemExit(main())
