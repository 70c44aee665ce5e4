"""The parallelism benchmarks run end to end on tiny configurations."""

from __future__ import annotations

from bench import decode_roofline, parallel_memory


def _rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| TP") and "---" not in line
    ]


def test_decode_roofline_small(capsys):
    decode_roofline.main(
        ["--small", "--tokens", "8", "--prompt-len", "16", "--repeats", "1", "--copy-mib", "8"]
        + ["--quantization", "int8"]
    )
    rows = [r for r in _rows(capsys.readouterr().out) if r[0] != "device"]
    assert len(rows) == 1 and rows[0][1] == "int8"
    tokens_per_s, fraction = float(rows[0][3]), float(rows[0][7])
    assert tokens_per_s > 0 and 0 < fraction


def test_parallel_memory_halves_per_device_bytes(capsys):
    parallel_memory.main(["--tp", "1", "2", "--layers", "1", "--materialize"])
    rows = _rows(capsys.readouterr().out)
    one, two = (float(r[1]) for r in rows)
    assert abs(two - one / 2) < 0.011  # norms replicated, everything else split
    assert [int(r[3]) for r in rows] == [8, 4]  # KV heads per device
