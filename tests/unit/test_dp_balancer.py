"""`DPBalancer`: least load first, lowest index on ties, prefix affinity within a margin."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxengine.core.dp_balancer import DPBalancer

BS = 4  # block size of these tests


def prompt(first: int, length: int = 3 * BS) -> list[int]:
    return [first + i for i in range(length)]


def test_least_loaded_wins_lowest_index_on_ties():
    balancer = DPBalancer(3, block_size=BS)
    assert balancer.choose([1, 2], [0, 0, 0]) == 0
    assert balancer.choose([1, 2], [2, 1, 1]) == 1
    assert balancer.choose([1, 2], [2, 3, 0]) == 2
    assert balancer.choose([1, 2], [5, 5, 5]) == 0


def test_short_prompts_have_no_affinity():
    balancer = DPBalancer(2, block_size=BS)
    short = [7] * (BS - 1)
    assert balancer.choose(short, [0, 0]) == 0
    assert balancer.choose(short, [1, 0]) == 1  # no memory: the least loaded


def test_affinity_holds_within_the_margin():
    balancer = DPBalancer(2, block_size=BS, margin=2)
    p = prompt(100)
    assert balancer.choose(p, [0, 1]) == 0
    assert balancer.choose(p, [1, 0]) == 0  # 1 busier than the least: stays
    assert balancer.choose(p, [2, 0]) == 0  # at the margin: stays
    assert balancer.choose(p, [3, 0]) == 1  # past it: moves to the least loaded
    assert balancer.choose(p, [0, 2]) == 1  # and now remembers replica 1


def test_affinity_is_by_leading_full_blocks():
    balancer = DPBalancer(2, block_size=BS, margin=1)
    assert balancer.choose(prompt(100), [1, 0]) == 1
    # same first block, different tail: still goes to the replica with that block
    shares_block0 = prompt(100, BS) + [999] * (2 * BS)
    assert balancer.choose(shares_block0, [0, 1]) == 1
    # a different first block: no affinity
    assert balancer.choose(prompt(500), [0, 1]) == 0


def test_longest_remembered_prefix_wins():
    balancer = DPBalancer(3, block_size=BS, margin=5)
    two_blocks = prompt(10, 2 * BS) + [1] * BS
    one_block = prompt(10, BS) + [0] * (2 * BS)
    assert balancer.choose(two_blocks, [9, 0, 9]) == 1  # blocks 0 and 1 -> replica 1
    assert balancer.choose(one_block, [0, 9, 9]) == 0  # too busy at 1: block 0 -> replica 0
    # shares two blocks with the request sent to 1, one block with the one sent to 0
    assert balancer.choose(prompt(10, 2 * BS) + [2] * BS, [0, 1, 0]) == 1
    # block 0 was last sent to replica 1 along with it
    assert balancer.choose(prompt(10, BS) + [3] * (2 * BS), [1, 0, 0]) == 1


def test_cache_salt_separates_affinity():
    balancer = DPBalancer(2, block_size=BS)
    p = prompt(100)
    assert balancer.choose(p, [1, 0], cache_salt="a") == 1
    assert balancer.choose(p, [0, 1], cache_salt="a") == 1
    assert balancer.choose(p, [0, 1], cache_salt="b") == 0


def test_memory_is_bounded_lru():
    balancer = DPBalancer(2, block_size=BS, affinity_blocks=1, margin=5, capacity=2)
    assert balancer.choose(prompt(100), [1, 0]) == 1
    balancer.choose(prompt(200), [0, 1])
    balancer.choose(prompt(300), [0, 1])  # evicts prompt(100)'s key
    assert len(balancer._last_replica) == 2
    assert balancer.choose(prompt(100), [0, 1]) == 0


def test_spreads_equal_load_over_replicas():
    balancer = DPBalancer(2, block_size=BS)
    loads = [0, 0]
    for i in range(10):
        loads[balancer.choose(prompt(1000 * i), loads)] += 1
    assert loads == [5, 5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_replicas"):
        DPBalancer(0)
    with pytest.raises(ValueError, match="3 loads given for 2 replicas"):
        DPBalancer(2).choose([1], [0, 0, 0])


def test_import_leaves_jax_out():
    code = "import sys, jaxengine.core.dp_balancer; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
