"""`python -m bench.sampler` on a small vocabulary: every random variant runs, and a
temperature-only batch is given the variant that sorts nothing."""

from __future__ import annotations

from bench.sampler import main


def test_every_random_variant_runs_and_temperature_alone_picks_no_sort(capsys):
    assert main(["--vocab", "64", "--rows", "2", "--steps", "1", "--max-model-len", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("filter_width=")]
    assert len(rows) == 3  # temperature alone, with filters, everything
    (picked,) = [line for line in rows if line.endswith("picked")]
    assert picked.startswith("filter_width=0,") and "1.00x" in picked
