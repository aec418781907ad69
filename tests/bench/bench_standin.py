"""A tiny stand-in OpenAI SSE server and websocket server, in raw trio, for the benchmark client's tests.

It streams one word per token (first after ttft_s, then every itl_s), reports usage with a word-level
prefix-cache count, and has paths that fail on purpose: /fail/500 answers 500, /fail/reset resets the
connection, /fail/stream sends an error object mid-stream.
"""

from __future__ import annotations

import json
import socket
import struct
from functools import partial
from dataclasses import dataclass, field

import trio
import trio_websocket


@dataclass
class StandIn:
    ttft_s: float = 0.02
    itl_s: float = 0.005
    seen: list[list[str]] = field(default_factory=list)
    bodies: list[dict[str, object]] = field(default_factory=list)

    def _prompt_words(self, body: dict[str, object]) -> list[str]:
        if "messages" in body:
            return " ".join(m["content"] for m in body["messages"]).split()  # type: ignore[index,union-attr]
        return str(body.get("prompt", "")).split()

    def usage(self, body: dict[str, object], n_out: int) -> dict[str, object]:
        words = self._prompt_words(body)
        cached = 0
        for prev in self.seen:
            k = 0
            while k < min(len(prev), len(words)) and prev[k] == words[k]:
                k += 1
            cached = max(cached, k)
        self.seen.append(words)
        return {
            "prompt_tokens": len(words), "completion_tokens": n_out, "total_tokens": len(words) + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _respond(self, stream: trio.SocketStream, head: bytes, body: bytes) -> None:
        request_line = head.split(b"\r\n", 1)[0].decode()
        method, path, _ = request_line.split(" ", 2)
        if method == "GET":
            payload = b'{"status":"ok"}' if path == "/health" else b'{"object":"list","data":[{"id":"standin"}]}'
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%s" % (len(payload), payload)
            )
            return
        if path == "/fail/reset/v1/completions":
            # SO_LINGER 0: close() sends RST, as an overflowing listen backlog does.
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            stream.socket.close()
            return
        if path == "/fail/500/v1/completions":
            msg = b'{"error":{"message":"boom"}}'
            await stream.send_all(
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (len(msg), msg)
            )
            return
        req = json.loads(body)
        self.bodies.append(req)
        chat = path.endswith("/chat/completions")
        n = int(req.get("max_tokens", 16))
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        )
        await trio.sleep(self.ttft_s)
        for i in range(n):
            if path.startswith("/fail/stream") and i == 1:
                await stream.send_all(b'data: {"error":{"message":"engine failed"}}\n\n')
                return
            piece = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
            chunk = {"choices": [{"index": 0, **piece, "finish_reason": "length" if i == n - 1 else None}]}
            await stream.send_all(f"data: {json.dumps(chunk)}\n\n".encode())
            if i < n - 1:
                await trio.sleep(self.itl_s)
        if (req.get("stream_options") or {}).get("include_usage"):
            await stream.send_all(f"data: {json.dumps({'choices': [], 'usage': self.usage(req, n)})}\n\n".encode())
        await stream.send_all(b"data: [DONE]\n\n")

    async def handle_http(self, stream: trio.SocketStream) -> None:
        buf = b""
        try:
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            head, body = buf.split(b"\r\n\r\n", 1)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
            while len(body) < length:
                body += await stream.receive_some(65536)
            await self._respond(stream, head, body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            try:
                await stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def handle_ws(self, request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            while True:
                msg = json.loads(await ws.get_message())
                rid, n = msg["id"], int(msg.get("max_tokens", 16))
                if msg.get("max_tokens") == 13:  # an injected failure
                    await ws.send_message(json.dumps({"type": "error", "id": rid, "message": "unlucky"}))
                    continue
                await trio.sleep(self.ttft_s)
                for i in range(n):
                    await ws.send_message(json.dumps({"type": "delta", "id": rid, "text": f" w{i}"}))
                    await trio.sleep(self.itl_s)
                await ws.send_message(json.dumps({"type": "done", "id": rid, "usage": self.usage(msg, n)}))
        except trio_websocket.ConnectionClosed:
            pass


async def serve(standin: StandIn, *, task_status: trio.TaskStatus[tuple[int, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve HTTP and websocket on two loopback ports; reports (http_port, ws_port) when ready."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, standin.handle_http, 0, host="127.0.0.1"))
        http_port = listeners[0].socket.getsockname()[1]
        ws_server = await nursery.start(trio_websocket.serve_websocket, standin.handle_ws, "127.0.0.1", 0, None)
        task_status.started((http_port, ws_server.port))
