"""`python -m bench.vision --quick`: both rows measured, both peers computing the same."""

from __future__ import annotations

import json

import pytest

from bench import tiny_vlm, vision


def _rows(text: str) -> dict[str, list[str]]:
    """The table's rows by measure: [jaxengine, transformers, speed-up]."""
    rows = {}
    for line in text.splitlines():
        for measure in ("encoder images/s", "image-prompt TTFT s"):
            if line.startswith(measure):
                rows[measure] = line[len(measure) :].split()[:3]
    return rows


@pytest.mark.slow
def test_quick_run_measures_both_rows(tmp_path, capsys):
    out = tmp_path / "vision.json"
    assert vision.main(["--quick", "--threads", "1", "--json", str(out)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"encoder images/s", "image-prompt TTFT s"}
    for ours, theirs, speedup in rows.values():
        assert float(ours.replace(",", "")) > 0 and float(theirs.replace(",", "")) > 0
        assert speedup.endswith("x") and float(speedup[:-1].replace(",", "")) > 0
    results = json.loads(out.read_text())["results"]
    assert results["encoder"]["max_rel_diff"] < 1e-4  # the same features from both encoders
    ttft = results["ttft"]
    assert len(ttft["seconds"]["jaxengine"]) == len(ttft["seconds"]["transformers"]) == 3
    assert ttft["same_first_token"] == 3  # greedy first token of the same prompt and image
    assert ttft["cached_tokens"] == 0  # fresh images: no prefix-cache hit in the timings
    assert results["compiles_after_warmup"] == 0


def test_quick_fills_sizes_counts_and_engine_arguments():
    args = vision.parse_args(["--quick", "--images", "7", "--engine-kwargs", '{"max_num_seqs": 1}'])
    assert args.size == tiny_vlm.QUICK and (args.images, args.rounds, args.repeats) == (7, 1, 3)
    assert args.engine_kwargs == {**vision.QUICK_ENGINE, "max_num_seqs": 1}
    full = vision.parse_args(["--vision-layers", "2"])
    assert full.size.vision_layers == 2 and full.size.text_layers == tiny_vlm.BENCH.text_layers
    assert (full.images, full.repeats, full.engine_kwargs) == (32, 10, {})


def test_size_flags_are_refused_with_a_folder_and_checked():
    with pytest.raises(SystemExit):
        vision.parse_args(["--model", "some/folder", "--text-layers", "2"])
    with pytest.raises(ValueError, match="multiple"):
        vision.parse_args(["--image-size", "24", "--patch-size", "8"])  # 3 x 3 patches
    assert tiny_vlm.BENCH.tokens_per_tile == 16 and tiny_vlm.QUICK.tokens_per_tile == 4
