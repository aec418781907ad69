"""Send one benchmark request over SSE (OpenAI-compatible HTTP) or trillm's websocket API, and time it."""

from __future__ import annotations

import errno
import json
import time
from dataclasses import dataclass, field

import httpx
import trio
import trio_websocket

from trillm.bench.harness.metrics import RequestRecord
from trillm.bench.harness.workloads import BenchRequest

TRANSPORTS = ("sse", "ws")


@dataclass(frozen=True, slots=True)
class Target:
    """One server under test."""

    name: str
    url: str  # base URL, e.g. http://127.0.0.1:8000
    transport: str = "sse"
    model: str | None = None  # sent as "model" when set; mlx_lm.server reloads on a model it does not know
    api: str = "auto"  # "auto" (chat for chat workloads), "chat" or "completions"
    api_key: str | None = None  # sent as a Bearer token

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def ws_url(self) -> str:
        base = self.url.rstrip("/")
        if base.startswith("http"):
            base = "ws" + base[4:]
        return base if base.endswith("/v1/ws") else base + "/v1/ws"


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """Sampling fields sent with every request."""

    temperature: float = 0.0
    ignore_eos: bool = False  # vLLM's extension; servers that do not know it ignore it
    timeout_s: float = 600.0
    keep_text: bool = False  # keep each request's generated text in its record (to compare servers' outputs)
    extra_body: dict[str, object] = field(default_factory=dict)


class StreamError(Exception):
    """The server reported an error inside the stream or broke the protocol."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def classify_error(exc: BaseException) -> str:
    """A short kind for an exception; connection refused and reset are kept apart (listen-backlog overflow)."""
    if isinstance(exc, StreamError):
        return exc.kind
    if isinstance(exc, httpx.HTTPStatusError):
        return f"http_{exc.response.status_code}"
    if isinstance(exc, (httpx.TimeoutException, trio.TooSlowError)):
        return "timeout"
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:  # the cause chain, into exception groups (trio's happy-eyeballs connect raises one)
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, ConnectionRefusedError) or getattr(cur, "errno", None) == errno.ECONNREFUSED:
            return "connection_refused"
        if isinstance(cur, (ConnectionResetError, BrokenPipeError)) or getattr(cur, "errno", None) in (
            errno.ECONNRESET, errno.EPIPE,
        ):
            return "connection_reset"
        text = str(cur).lower()
        if "connection refused" in text:
            return "connection_refused"
        if "connection reset" in text or "broken pipe" in text:
            return "connection_reset"
        todo.extend(getattr(cur, "exceptions", ()))
        todo.extend(e for e in (cur.__cause__, cur.__context__) if e is not None)
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection_closed"  # e.g. "Server disconnected without sending a response."
    if isinstance(exc, (httpx.ConnectError, OSError, trio_websocket.HandshakeError)):
        return "connect_error"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, trio_websocket.ConnectionClosed)):
        return "connection_closed"
    return type(exc).__name__


def _body(req: BenchRequest, chat: bool, target: Target, opts: GenerationOptions) -> dict[str, object]:
    body: dict[str, object] = {
        "max_tokens": req.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = req.message_dicts() if req.is_chat else [{"role": "user", "content": req.prompt}]
    else:
        if req.is_chat:
            raise ValueError(f"request {req.request_id} is a chat; it cannot go to /v1/completions")
        body["prompt"] = req.prompt
    if target.model:
        body["model"] = target.model
    if opts.ignore_eos:
        body["ignore_eos"] = True
    body.update(opts.extra_body)
    return body


class _Timer:
    """Collects chunk times and usage for one request."""

    def __init__(self, t0: float, keep_text: bool = False) -> None:
        self.t0 = t0
        self.chunks: list[float] = []
        self.usage: dict[str, object] | None = None
        self.chars = 0
        self.pieces: list[str] | None = [] if keep_text else None

    def text(self, s: str | None) -> None:
        if s:
            self.chunks.append(time.perf_counter() - self.t0)
            self.chars += len(s)
            if self.pieces is not None:
                self.pieces.append(s)

    def record(self, req: BenchRequest, run_t0: float, error: BaseException | None = None) -> RequestRecord:
        u = self.usage or {}
        details = u.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return RequestRecord(
            request_id=req.request_id,
            start=self.t0 - run_t0,
            latency=time.perf_counter() - self.t0,
            chunk_times=tuple(self.chunks),
            prompt_tokens=u.get("prompt_tokens"),  # type: ignore[arg-type]
            completion_tokens=u.get("completion_tokens"),  # type: ignore[arg-type]
            cached_tokens=cached,
            num_chars=self.chars,
            error_kind=None if error is None else classify_error(error),
            error=None if error is None else f"{type(error).__name__}: {error}"[:500],
            turn=req.turn,
            text=None if self.pieces is None else "".join(self.pieces),
        )


def _chunk_text(chunk: dict[str, object], chat: bool) -> str | None:
    choices = chunk.get("choices") or []
    if not choices:
        return None
    c0 = choices[0]  # type: ignore[index]
    if not chat:
        text: str | None = c0.get("text")
        return text
    delta = c0.get("delta") or {}
    content: str | None = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return content


async def send_sse(
    client: httpx.AsyncClient, target: Target, req: BenchRequest, opts: GenerationOptions, run_t0: float
) -> RequestRecord:
    """POST one streaming request and time every chunk that carries text."""
    chat = target.api == "chat" or (target.api == "auto" and req.is_chat)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    timer = _Timer(time.perf_counter(), opts.keep_text)
    try:
        body = _body(req, chat, target, opts)
        with trio.fail_after(opts.timeout_s):
            async with client.stream("POST", target.url.rstrip("/") + path, json=body, headers=target.headers) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise StreamError(f"http_{resp.status_code}", resp.text[:300])
                done = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and ": ping" comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise StreamError("server_error", json.dumps(chunk["error"])[:300])
                    timer.text(_chunk_text(chunk, chat))
                    if chunk.get("usage"):
                        timer.usage = chunk["usage"]
                if not done:
                    raise StreamError("incomplete_stream", "the stream ended without data: [DONE]")
    except Exception as exc:  # every failure is a counted record, never dropped
        return timer.record(req, run_t0, exc)
    return timer.record(req, run_t0)


async def send_ws(target: Target, req: BenchRequest, opts: GenerationOptions, run_t0: float) -> RequestRecord:
    """One request over trillm's websocket API, on its own connection."""
    timer = _Timer(time.perf_counter(), opts.keep_text)
    msg: dict[str, object] = {"type": "generate", "id": req.request_id}
    msg.update(_body(req, req.is_chat, target, opts))
    for key in ("stream", "stream_options"):
        msg.pop(key, None)
    try:
        with trio.fail_after(opts.timeout_s):
            headers = [(k.encode(), v.encode()) for k, v in target.headers.items()]
            async with trio_websocket.open_websocket_url(target.ws_url, extra_headers=headers) as ws:
                await ws.send_message(json.dumps(msg))
                while True:
                    event = json.loads(await ws.get_message())
                    if event.get("id") not in (None, req.request_id):
                        continue
                    kind = event.get("type")
                    if kind == "delta":
                        timer.text(event.get("text"))
                    elif kind == "done":
                        timer.usage = event.get("usage")
                        break
                    elif kind == "error":
                        detail = event.get("error") or event.get("message")
                        raise StreamError("server_error", json.dumps(detail)[:300])
                    elif kind == "cancelled":
                        raise StreamError("cancelled", "the server cancelled the generation")
    except Exception as exc:
        return timer.record(req, run_t0, exc)
    return timer.record(req, run_t0)
