"""bench/kernels.py runs end to end on tiny shapes (the Pallas kernel interpreted)."""

from __future__ import annotations

from bench import kernels


def test_small_run_reports_every_peer(capsys):
    kernels.main(["--small", "--interpret", "--iters", "1", "--copy-mib", "8"])
    table = capsys.readouterr().out
    for workload in ("decode", "mixed"):
        for peer in ("pallas", "reference", "xla-cpu", "dot_product_attention"):
            line = next(row for row in table.splitlines() if row.split()[:2] == [workload, peer])
            assert "error" not in line, line
    # pallas, reference and the CPU path, for each workload
    assert table.count("max |err| vs reference") == 6
