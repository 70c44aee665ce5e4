"""`jaxengine serve [MODEL]`: the OpenAI-compatible HTTP server.

Loads the model (default: the demo SmolLM2-135M-Instruct) and serves at once while a
background thread compiles every step shape (``--no-background-compile``: compile
them all first; ``--enforce-eager``: compile each on first use). It serves
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/tokenize``, ``/detokenize``,
``/health``, ``/version``, ``/metrics`` (and ``/load`` with
``--enable-server-load-tracking``), vLLM's ``/v1/chat/completions/batch``, SageMaker's
``/invocations`` and ``/ping`` (and ``/tokenizer_info`` with
``--enable-tokenizer-info-endpoint``) on ``--host``/``--port``.

    jaxengine serve --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

One engine over two hosts (tensor parallelism across them): node 0 serves, node 1
follows its steps and opens no port.

    jaxengine serve MODEL -tp 16 --nnodes 2 --node-rank 0 --master-addr HOST0
    jaxengine serve MODEL -tp 16 --nnodes 2 --node-rank 1 --master-addr HOST0 --headless

Four data-parallel replicas on two hosts behind HOST0's API server (ranks 0-1 on
HOST0, 2-3 on the headless node; both must share $JAXENGINE_DP_AUTHKEY):

    jaxengine serve MODEL -dp 4 -dpl 2 --data-parallel-address HOST0 \\
        --data-parallel-rpc-port 13345
    jaxengine serve MODEL -dp 4 -dpl 2 -dpr 2 --data-parallel-address HOST0 \\
        --data-parallel-rpc-port 13345 --headless
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from server.api_server.args import add_server_args

    parser = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible API server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from server.api_server.launch import serve

    return serve(args)
