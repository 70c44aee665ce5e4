"""`python -m bench.sampler` on a small vocabulary: every random variant runs, and a
temperature-only batch is given the filter variant (its sort skipped at run time)."""

from __future__ import annotations

from bench.sampler import main


def test_every_random_variant_runs_and_temperature_alone_picks_the_filter_variant(capsys):
    assert main(["--vocab", "64", "--rows", "2", "--steps", "1", "--max-model-len", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("filter_width=")]
    assert len(rows) == 4  # picked twice (with and without a top-p row), everything, floor
    (picked,) = [line for line in rows if line.endswith("picked")]
    assert picked.startswith("filter_width=64,") and "temperature 1" in picked
    assert "1.00x" in picked and rows[0] == picked
    assert rows[-1].startswith("filter_width=0,")
