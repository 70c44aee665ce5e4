"""`jaxengine.messages`: what crosses a process or host boundary.

Every message survives `dumps`/`loads` unchanged; what cannot be pickled fails with
a ValueError that says why; a peer of another `PROTOCOL_VERSION` is refused naming
both versions; and the module is a leaf (the standard library only), so both ends
of a channel import it without the engine. The refusal over a real socket is
tests/unit/test_dp_remote.py's.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import jaxengine.messages as m
from jaxengine.outputs import CompletionOutput, RequestOutput

ALL_MESSAGES = [
    m.FollowerHello(3),
    m.DriverWelcome({"config": "any picklable object"}),
    m.Refused("why"),
    m.Warmup(progress=False),
    m.ExecuteStep(scheduler_output=("a", "step")),
    m.Shutdown(),
    m.Register(m.NodeInfo((2, 3), 4, 128, 256, "host")),
    m.Ready(),
    m.AddRequest(2, "r-0", prompt=("text", [1, 2]), priority=-1),
    m.AbortRequests(3, ("r-0", "r-1")),
    m.Close(),
    m.Batch(
        (
            m.Output(
                2,
                RequestOutput(
                    "r", None, [1], None, [CompletionOutput(0, "", [5], None, None, "stop")], True
                ),
            ),
            m.RequestError(2, "r", ValueError("bad")),
            m.Stats(3, "scheduler", "iteration"),
            m.Dead(3, "device lost"),
        )
    ),
]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips(message):
    back = m.loads(m.dumps(message))
    assert type(back) is type(message)
    if isinstance(message, m.Batch):  # exceptions compare by identity: compare their text
        assert [type(i) for i in back.items] == [type(i) for i in message.items]
        assert repr(back.items[1].error) == repr(message.items[1].error)
        assert back.items[0] == message.items[0]
    else:
        assert back == message


def test_messages_are_frozen_and_hellos_carry_the_version():
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.Warmup(True).progress = False  # type: ignore[misc]
    assert m.FollowerHello(1).version == m.PROTOCOL_VERSION
    assert m.Register(m.NodeInfo((1,), 2, 8, 8, "h")).version == m.PROTOCOL_VERSION


def test_another_version_is_refused_with_both_versions():
    m.check_version(m.PROTOCOL_VERSION, "the driver")  # same version: fine
    other = m.PROTOCOL_VERSION + 1
    with pytest.raises(m.ProtocolMismatchError) as info:
        m.check_version(other, "follower node 2")
    text = str(info.value)
    assert f"follower node 2 speaks jaxengine protocol version {other}" in text
    assert f"this process version {m.PROTOCOL_VERSION}" in text
    assert isinstance(info.value, RuntimeError)


def test_what_cannot_be_pickled_is_a_clear_value_error(monkeypatch):
    with pytest.raises(ValueError, match="could not be sent to the other nodes"):
        m.dumps(m.AddRequest(1, "r", prompt=threading.Lock()))  # nothing pickles a lock
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # as if not installed
    with pytest.raises(ValueError, match="pip install cloudpickle"):
        m.dumps(m.ExecuteStep(lambda: 0))


def test_messages_is_a_leaf_module():
    tree = ast.parse(Path(m.__file__).read_text())
    imported = set()
    for node in tree.body:  # top level only: the TYPE_CHECKING block is not run
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    code = "import sys, jaxengine.messages; print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = set(ast.literal_eval(out.stdout))
    assert "jax" not in modules and "numpy" not in modules
    ours = {name for name in modules if name.startswith("jaxengine.")}
    # the package's __init__: its version, and the platform choice (stdlib only)
    assert ours <= {"jaxengine.messages", "jaxengine.version", "jaxengine.platforms"}, ours
