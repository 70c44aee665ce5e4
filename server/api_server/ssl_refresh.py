"""``--enable-ssl-refresh``: reload the served certificate when its files change.

uvicorn builds one `ssl.SSLContext` at start-up and wraps every new connection with
it. Loading a new chain into that same context (``load_cert_chain``) changes what new
handshakes present; connections already open keep their session. `SSLCertRefresher`
polls the key, certificate and CA files' modification stamps (vLLM watches them with
``watchfiles``; a stat per file each second needs no extra package) and reloads what
changed. A reload that fails, e.g. on a half-written file or a key that does not match
the certificate yet, is logged and tried again when the files next change (the rest of
the write, the matching key); the context keeps serving the previous chain meanwhile
(each load is tried on a scratch context first).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
from pathlib import Path

logger = logging.getLogger("jaxengine.server")

Stamp = tuple[int, int] | None
"""A file's (mtime in ns, size), or None when it cannot be read."""


def _stamp(path: str) -> Stamp:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


class SSLCertRefresher:
    """Reloads ``keyfile``/``certfile`` (and ``ca_certs``) into ``context`` when a
    file's stamp changes. `check` does one poll; `run` polls every ``interval``
    seconds until cancelled."""

    def __init__(
        self,
        context: ssl.SSLContext,
        keyfile: str,
        certfile: str,
        ca_certs: str | None = None,
        interval: float = 1.0,
    ) -> None:
        self.context = context
        self.keyfile, self.certfile, self.ca_certs = keyfile, certfile, ca_certs
        self.interval = interval
        self._chain = self._chain_stamp()
        self._ca = _stamp(ca_certs) if ca_certs else None

    def _chain_stamp(self) -> tuple[Stamp, Stamp]:
        return _stamp(self.keyfile), _stamp(self.certfile)

    def check(self) -> list[str]:
        """Reloads what changed since the last poll; the names reloaded ("cert
        chain", "ca certs"). A failed load is tried again once its files change."""
        reloaded = []
        chain = self._chain_stamp()
        if chain != self._chain:
            self._chain = chain
            if self._reload("cert chain", "load_cert_chain", self.certfile, self.keyfile):
                reloaded.append("cert chain")
        ca = _stamp(self.ca_certs) if self.ca_certs else None
        if ca != self._ca:
            self._ca = ca
            if self._reload("ca certs", "load_verify_locations", self.ca_certs):
                reloaded.append("ca certs")
        return reloaded

    def _reload(self, what: str, method: str, *paths: str) -> bool:
        """Loads ``paths`` into the live context with ``method``, after a load into a
        scratch context succeeded: OpenSSL takes a new certificate before it finds
        that the key does not match, so a failed load would leave the live context
        unable to serve. Both loads read one copy of the files, taken first."""
        try:
            with tempfile.TemporaryDirectory() as folder:
                copies = []
                for i, path in enumerate(paths):
                    copy = Path(folder) / str(i)
                    copy.write_bytes(Path(path).read_bytes())
                    copies.append(str(copy))
                getattr(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), method)(*copies)
                getattr(self.context, method)(*copies)
        except (OSError, ssl.SSLError) as e:
            logger.warning("SSL %s not reloaded from %s: %s", what, ", ".join(paths), e)
            return False
        logger.info("SSL %s reloaded from %s", what, ", ".join(paths))
        return True

    async def run(self) -> None:
        """Polls until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            self.check()
