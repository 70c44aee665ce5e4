"""vLLM's remaining frontend flags of `jaxengine serve`, without a server: each parses
with vLLM's name and default, and then either does what vLLM's does or is refused at
start-up. Logging config, the h11 limits and the SSL refresh are checked on the
objects the server runs with (uvicorn's Config, a real SSLContext in a TLS handshake
over memory buffers); the request-level flags are in test_server_request_logs.py.

The two TLS key pairs in ``tls/`` are self-signed P-256 test certificates, made with
``openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 36500``.
"""

from __future__ import annotations

import json
import logging
import shutil
import ssl
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.engine_args import EngineArgs
from server import envs
from server.api_server.args import add_server_args, check_server_args
from server.api_server.launch import load_log_config, setup_logging, ssl_refresher, uvicorn_config
from server.api_server.ssl_refresh import SSLCertRefresher
from tests.unit.logs import captured

TLS = Path(__file__).with_name("tls")


def serve_args(*argv: str):
    return add_server_args(FlexibleArgumentParser()).parse_args(list(argv))


def test_defaults_are_vllms():
    args = serve_args()
    assert args.enable_log_requests is False and args.enable_log_outputs is False
    assert args.log_error_stack is False and args.trust_request_chat_template is False
    assert args.enable_ssl_refresh is False and args.tool_server is None
    assert args.h11_max_incomplete_event_size == 4194304
    assert args.h11_max_header_count == 256
    check_server_args(args)


@pytest.mark.parametrize(
    "flag, dest",
    [
        ("enable-log-requests", "enable_log_requests"),
        ("enable-log-outputs", "enable_log_outputs"),
        ("log-error-stack", "log_error_stack"),
        ("trust-request-chat-template", "trust_request_chat_template"),
        ("enable-ssl-refresh", "enable_ssl_refresh"),
    ],
)
def test_boolean_flags_have_no_forms(flag, dest):
    assert getattr(serve_args(f"--{flag}"), dest) is True
    assert getattr(serve_args(f"--{flag}", f"--no-{flag}"), dest) is False


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tool-server", "demo"],
            "--tool-server demo is not supported yet: jaxengine has no built-in tools",
        ),
        (["--tool-server", "localhost:8001"], "--tool-server localhost:8001 is not supported"),
        (["--enable-log-outputs"], "--enable-log-outputs requires --enable-log-requests"),
        (
            ["--enable-ssl-refresh"],
            "--enable-ssl-refresh requires --ssl-keyfile and --ssl-certfile",
        ),
        (
            ["--enable-ssl-refresh", "--ssl-certfile", "c.pem"],
            "--enable-ssl-refresh requires --ssl-keyfile",
        ),
        (["--h11-max-header-count", "0"], "--h11-max-header-count must be >= 1, got 0"),
        (["--h11-max-incomplete-event-size", "-1"], "--h11-max-incomplete-event-size must be >="),
        (["--api-server-count", "4"], "--api-server-count=4 is not supported: jaxengine's engine"),
        (["-asc", "0"], "--api-server-count=0 is not supported: .* use --headless"),
    ],
)
def test_flags_refused_at_start_up(argv, message):
    with pytest.raises(ValueError, match=message):
        check_server_args(serve_args(*argv))


def test_disable_frontend_multiprocessing_is_accepted():
    """vLLM's flag (its metrics test serves with it) asks for what is always so here:
    the engine in the API server's process."""
    args = serve_args("--disable-frontend-multiprocessing")
    assert args.disable_frontend_multiprocessing is True
    check_server_args(args)


def test_log_outputs_with_log_requests_is_accepted():
    check_server_args(serve_args("--enable-log-requests", "--enable-log-outputs"))


# ---------------------------------------------------------------------- deprecated flags


def test_disable_log_requests_is_a_deprecated_negation():
    """vLLM's --disable-log-requests (deprecated for --enable-log-requests): request
    logging off, its --no- form on; the last flag given wins; each use is warned."""
    with captured("jaxengine.server") as log:
        assert serve_args("--disable-log-requests").enable_log_requests is False
        assert serve_args("--no-disable-log-requests").enable_log_requests is True
        both = serve_args("--enable-log-requests", "--disable-log-requests")
        assert both.enable_log_requests is False
        assert serve_args("--disable-log-requests", "--enable-log-requests").enable_log_requests
    warned = log.messages(logging.WARNING)
    assert warned[0] == (
        "--disable-log-requests is deprecated, as in vLLM: use --no-enable-log-requests "
        "(the default) instead"
    )
    assert warned[1] == (
        "--no-disable-log-requests is deprecated, as in vLLM: use --enable-log-requests instead"
    )
    assert len(warned) == 4
    assert serve_args().enable_log_requests is False  # no flag: no warning, off


def engine_args(*argv: str) -> EngineArgs:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv, options",
    [
        (["--guided-decoding-backend", "guidance"], {"backend": "guidance"}),
        (["--guided-decoding-disable-fallback"], {"disable_fallback": True}),
        (["--guided-decoding-disable-any-whitespace", "true"], {"disable_any_whitespace": True}),
        (
            ["--guided-decoding-disable-additional-properties", "false"],
            {"disable_additional_properties": False},
        ),
        (
            ["--guided-decoding-backend", "auto", "--structured-outputs-config.backend", "auto"],
            {"backend": "auto"},
        ),
        (
            ["--structured-outputs-config", '{"disable_fallback": true}',
             "--guided-decoding-disable-any-whitespace"],
            {"disable_fallback": True, "disable_any_whitespace": True},
        ),
    ],
)  # fmt: skip
def test_guided_decoding_flags_are_structured_outputs_keys(argv, options):
    with captured("jaxengine.config") as log:
        args = engine_args(*argv)
    assert args.structured_outputs_config == options
    so = args.create_engine_config().structured_outputs_config
    assert all(so.option(key) == value for key, value in options.items())
    flag = next(a for a in argv if a.startswith("--guided"))
    key = flag.removeprefix("--guided-decoding-").replace("-", "_")
    assert log.messages(logging.WARNING) == [
        f"{flag} is deprecated, as in vLLM (removed in v0.12.0): use "
        f"--structured-outputs-config.{key} instead"
    ]


def test_guided_decoding_flags_are_checked_as_the_config_is(capsys):
    disagree = ["--structured-outputs-config.backend", "auto"]
    with pytest.raises(SystemExit):  # disagrees with the JSON key
        engine_args(*disagree, "--guided-decoding-backend", "guidance")
    wanted = "--guided-decoding-backend guidance and --structured-outputs-config.backend auto"
    assert f"{wanted} disagree" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a vLLM backend
        engine_args("--guided-decoding-backend", "lm-format-enforcer")
    assert "backend 'lm-format-enforcer' is not one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        engine_args("--guided-decoding-disable-fallback", "maybe")
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err
    with pytest.raises(NotImplementedError, match="backend xgrammar is not supported yet"):
        engine_args("--guided-decoding-backend", "xgrammar").create_engine_config()


# ---------------------------------------------------------------------- logging config

LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "CUSTOM %(name)s %(message)s"}},
    "handlers": {"file": {"class": "logging.FileHandler", "formatter": "plain"}},
    "loggers": {"jaxengine.test_log_config": {"handlers": ["file"], "level": "INFO"}},
}


def test_log_config_file_is_applied(tmp_path, monkeypatch):
    """--log-config-file (default $VLLM_LOGGING_CONFIG_PATH): a dictConfig JSON,
    applied to the jaxengine loggers at start-up and given to uvicorn for its own."""
    out = tmp_path / "out.log"
    handler = {**LOG_CONFIG["handlers"]["file"], "filename": str(out)}
    config = {**LOG_CONFIG, "handlers": {"file": handler}}
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(path))
    args = serve_args()
    assert args.log_config_file == str(path) == envs.logging_config_path()
    assert serve_args("--log-config-file", "other.json").log_config_file == "other.json"
    loaded = load_log_config(args.log_config_file)
    assert loaded == config
    logger = logging.getLogger("jaxengine.test_log_config")
    try:
        setup_logging("info", config=loaded)
        logger.info("hello")
        assert out.read_text() == "CUSTOM jaxengine.test_log_config hello\n"
        assert uvicorn_config(object(), args, loaded).log_config == loaded
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()


def test_bad_log_config_files_are_refused(tmp_path):
    assert load_log_config(None) is None
    with pytest.raises(ValueError, match="Could not load logging config from .*missing"):
        load_log_config(str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="Expected dict, got list"):
        load_log_config(str(tmp_path / "list.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_log_config(str(tmp_path / "bad.json"))
    off = {"VLLM_CONFIGURE_LOGGING": "0"}
    with pytest.raises(ValueError, match="VLLM_CONFIGURE_LOGGING evaluated to false"):
        load_log_config(str(tmp_path / "list.json"), off)


# ---------------------------------------------------------------------- h11


def test_h11_settings_reach_uvicorn():
    args = serve_args("--h11-max-incomplete-event-size", "65536")
    config = uvicorn_config(object(), args)
    assert config.http == "h11"  # the parser these settings are for, whatever is installed
    assert config.h11_max_incomplete_event_size == 65536
    assert uvicorn_config(object(), serve_args()).h11_max_incomplete_event_size == 4194304


async def _ok(scope, receive, send):
    """An ASGI app answering 200 (and its lifespan)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        return await send({"type": "lifespan.shutdown.complete"})
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_h11_incomplete_event_size_limits_a_real_server():
    """uvicorn with the flags' settings, on a local port: a request head still
    incomplete past --h11-max-incomplete-event-size bytes is refused by h11 (uvicorn
    answers 400); a complete one under it is served."""
    import asyncio

    import uvicorn

    from tests.processes import free_port

    port = free_port()
    argv = ["--host", "127.0.0.1", "--port", str(port), "--h11-max-incomplete-event-size", "1024"]
    server = uvicorn.Server(uvicorn_config(_ok, serve_args(*argv, "--disable-uvicorn-access-log")))

    async def status(head: bytes) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)
        await writer.drain()
        line = await reader.readline()
        writer.close()
        return int(line.split()[1])

    async def main() -> list[int]:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            start = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: "
            whole = await status(start + b"a" * 900 + b"\r\n\r\n")
            return [whole, await status(start + b"a" * 4000)]  # still incomplete past 1024
        finally:
            server.should_exit = True
            await serving

    assert asyncio.run(main()) == [200, 400]


# ---------------------------------------------------------------------- SSL refresh


def _served_certificate(server: ssl.SSLContext) -> bytes:
    """The DER certificate ``server`` presents in a TLS handshake (over memory BIOs)."""
    client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_context.check_hostname, client_context.verify_mode = False, ssl.CERT_NONE
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_context.wrap_bio(c_in, c_out)
    served = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(8):
        for name, end in (("client", client), ("server", served)):
            try:
                end.do_handshake()
                done[name] = True
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return client.getpeercert(binary_form=True)
    raise AssertionError("no handshake")


def _der(name: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert((TLS / f"{name}.crt").read_text())


def _install(pair: str, key: Path, cert: Path) -> None:
    shutil.copyfile(TLS / f"{pair}.key", key)
    shutil.copyfile(TLS / f"{pair}.crt", cert)


def test_ssl_refresh_serves_the_new_certificate(tmp_path):
    """--enable-ssl-refresh: the server's own SSL context (uvicorn's, built from the
    flags) presents the new certificate to new connections once its files change; a
    half-replaced pair (key and certificate that do not match) is logged and left
    until the files change again."""
    key, cert = tmp_path / "server.key", tmp_path / "server.crt"
    _install("a", key, cert)
    argv = ["--enable-ssl-refresh", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    args = serve_args(*argv)
    check_server_args(args)
    config = uvicorn_config(object(), args)
    refresher = ssl_refresher(config, args)
    assert refresher.context is config.ssl
    assert _served_certificate(config.ssl) == _der("a")
    assert refresher.check() == []  # nothing changed
    shutil.copyfile(TLS / "b.crt", cert)  # the certificate first: it does not match the key
    with captured("jaxengine.server") as log:
        assert refresher.check() == []
    assert "SSL cert chain not reloaded" in log.messages(logging.WARNING)[0]
    assert _served_certificate(config.ssl) == _der("a")
    assert refresher.check() == []  # no change since: not tried again
    shutil.copyfile(TLS / "b.key", key)
    assert refresher.check() == ["cert chain"]
    assert _served_certificate(config.ssl) == _der("b")
    assert ssl_refresher(config, serve_args(*argv[1:])) is None


def test_ssl_refresh_reloads_ca_certificates(tmp_path):
    key, cert, ca = tmp_path / "k", tmp_path / "c", tmp_path / "ca"
    _install("a", key, cert)
    shutil.copyfile(TLS / "a.crt", ca)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.load_verify_locations(ca)
    refresher = SSLCertRefresher(context, str(key), str(cert), str(ca))
    shutil.copyfile(TLS / "b.crt", ca)
    assert refresher.check() == ["ca certs"]
    subjects = [dict(x[0] for x in c["subject"])["commonName"] for c in context.get_ca_certs()]
    assert "jaxengine-test-b" in subjects


def test_ssl_refresher_runs_with_the_server():
    """`_serve` polls while uvicorn serves and stops polling when it returns."""
    import asyncio

    from server.api_server import launch

    polls, cancelled = [], []

    class Refresher:
        async def run(self):
            try:
                while True:
                    polls.append(1)
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

    class Server:
        async def serve(self):
            for _ in range(5):
                await asyncio.sleep(0)

    async def main():
        models = SimpleNamespace(add_static=lambda modules: asyncio.sleep(0), cards=lambda: [])
        await launch._serve(Server(), models, [], "here", Refresher())
        during = len(polls)
        for _ in range(5):
            await asyncio.sleep(0)
        return during, len(polls), list(cancelled)

    during, after, stopped = asyncio.run(main())
    assert during >= 2 and after == during and stopped == [True]
