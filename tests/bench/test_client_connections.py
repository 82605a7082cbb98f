"""The benchmark client's transport: one multipart body per distinct upload, sent as is, and
at most ``concurrency`` connections (one request at a time on each)."""

from __future__ import annotations

import asyncio

from edserve.bench.client import BenchTarget, LoadPlan, encode_upload, run_load
from edserve.bench.load import AudioItem


class _Server:
    """A minimal HTTP/1.1 server: records every body and connection, answers {"text": "ok"}."""

    def __init__(self) -> None:
        self.bodies: list[tuple[bytes, bytes]] = []  # (content-type, body)
        self.connections = 0
        self.in_flight = self.most_in_flight = 0

    async def handle(self, reader, writer) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
                fields = {k.lower(): v for k, v in fields.items()}
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                body = await reader.readexactly(int(fields[b"content-length"]))
                self.bodies.append((fields[b"content-type"], body))
                await asyncio.sleep(0.002)
                self.in_flight -= 1
                answer = b'{"text": "ok"}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_bodies_are_encoded_once_and_connections_capped():
    items = [AudioItem("a.wav", b"RIFF" + bytes(5000), 1.0),
             AudioItem("b.wav", b"RIFF" + bytes(9000), 2.0)]

    async def go():
        srv = _Server()
        server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = BenchTarget(f"http://127.0.0.1:{port}", fields=(("language", "en"),))
        async with server:
            results, wall = await run_load(target, LoadPlan(items * 20, concurrency=6))
        return srv, target, results, wall

    srv, target, results, wall = asyncio.run(go())
    assert len(results) == 40 and all(r.ok and r.text == "ok" for r in results) and wall > 0
    assert srv.connections <= 6 and srv.most_in_flight <= 6
    assert len({ct for ct, _ in srv.bodies}) == 2  # one encoded body per distinct upload
    body_a = encode_upload(target, items[0])[0]
    assert b'name="language"' in body_a and b"en" in body_a and items[0].data in body_a
    assert sum(len(b) == len(body_a) for _, b in srv.bodies) == 20
