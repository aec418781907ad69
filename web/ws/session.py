"""The websocket API, /v1/ws: many generations multiplexed on one socket, each cancellable.

Client -> server: {"type": "generate", "id": ..., <chat or completion params>} and {"type": "cancel", "id"}.
Server -> client: {"type": "delta", "id", "index", "text", "token_ids", "logprobs", "finish_reason"} ...
(a chat delta with "reasoning" and "tool_calls" when its output has them: the output events every surface
renders, so "text" is the answer alone), then {"type": "done", "id", "usage", "finish_reasons"}; or
{"type": "cancelled", "id"}; or {"type": "error", "id", "error": {...}}. A malformed message gets an error
and the socket stays open. Closing the socket cancels the handler (quart-trio), which aborts every
generation it started.

Browsers cannot set an Authorization header on a websocket, so a client may instead offer the subprotocols
"trillm" and "trillm.bearer.<the API key, base64url without padding>"; the server then selects "trillm".
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from quart import websocket
from quart_trio import QuartTrio

from trillm.engine.errors import EngineError
from trillm.web.config import ServerConfig
from trillm.web.errors import APIError, parse_object, to_api_error
from trillm.web.openai.request import completion_prompts
from trillm.web.openai.response import StreamedDelta, event_delta, finish_reason, response_builder, usage_dict
from trillm.web.openai.schema import ChatCompletionRequest, CompletionRequest
from trillm.web.openai.submit import start_generation
from trillm.web.service.engine_service import EngineService
from trillm.web.service.registry import ModelNotFound, ModelRegistry
from trillm.web.service.stream import GenerationFailed
from trillm.web.ws.envelope import BadMessage, encode_message, generate_fields, parse_message, refusal

log = logging.getLogger("trillm.web.ws.session")

SUBPROTOCOL = "trillm"
class _Session:
    """One socket: its generations run in the handler's nursery; one writer task owns the socket's sends."""

    def __init__(self, nursery: trio.Nursery, out: trio.MemorySendChannel[str | None], registry: ModelRegistry,
                 config: ServerConfig) -> None:
        self.nursery = nursery
        self.out = out
        self.registry = registry
        self.config = config
        self.active: dict[str, trio.CancelScope] = {}
        self.num_requests = 0  # engine requests (n per prompt of each generation) running on this socket
        self.emptied = trio.Event()  # set whenever the last generation ends

    async def send(self, msg: dict[str, Any]) -> None:
        await self.out.send(encode_message(msg))  # APIError past MAX_SEND_BYTES: that generation fails alone

    async def error(self, gid: object, exc: BaseException) -> None:
        await self.send({"type": "error", "id": gid, "error": to_api_error(exc).body()["error"]})

    async def on_message(self, raw: str | bytes) -> None:
        try:
            msg, gid = parse_message(raw)  # the envelope, read exactly as the router reads it
        except BadMessage as exc:
            await self.error(exc.gid, exc.error)
            return
        key = str(gid)
        if (refused := refusal(msg, gid, self.active, self.config.max_ws_generations)) is not None:
            await self.error(gid, refused)
        elif msg["type"] == "cancel":
            self.active[key].cancel()
        else:
            await self.nursery.start(self.generate, gid, key, msg)

    async def generate(self, gid: str | int, key: str, msg: dict[str, Any],
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self.active[key] = scope
            task_status.started()
            try:
                await self._generate(gid, msg)
            except (EngineError, APIError, GenerationFailed, ModelNotFound) as exc:
                await self.error(gid, exc)
            except Exception as exc:  # one bad generation must not take the socket down
                log.exception("websocket generation %r failed", gid, exc_info=exc)
                await self.error(gid, exc)
            finally:
                del self.active[key]
                if not self.active:
                    self.emptied.set()
        if scope.cancelled_caught:
            await self.send({"type": "cancelled", "id": gid})

    async def _generate(self, gid: str | int, msg: dict[str, Any]) -> None:
        # Always streamed (so no cap on a whole response applies): deltas go out as they come.
        chat, fields = generate_fields(msg)
        fields["stream"] = True
        body: ChatCompletionRequest | CompletionRequest = (
            parse_object(ChatCompletionRequest, fields) if chat else parse_object(CompletionRequest, fields))
        n = body.n * (len(completion_prompts(body)) if isinstance(body, CompletionRequest) else 1)
        if self.num_requests + n > self.config.max_ws_requests:
            raise APIError(429, f"this socket runs at most {self.config.max_ws_requests} requests at once "
                                "(counting each of n choices of each prompt)")
        service = self.registry.select(body.model)
        self.num_requests += n
        try:
            await self._stream(gid, service, body)
        finally:
            self.num_requests -= n

    async def _stream(self, gid: str | int, service: EngineService, body: ChatCompletionRequest | CompletionRequest,
                      ) -> None:
        req, handle, tokenizer = await start_generation(service, body, self.config)
        builder = response_builder(req, handle.request_ids, tokenizer)
        with handle:
            while True:
                try:
                    outputs = await handle.receive_batch()
                except trio.EndOfChannel:
                    break
                for out in outputs:
                    await self.send(delta_message(gid, builder.stream_delta(out), out.new_token_ids))
        await self.send({"type": "done", "id": gid, "usage": usage_dict(builder.total_usage()),
                         "finish_reasons": [finish_reason(c.finish) for c in builder.choices]})


def delta_message(gid: str | int, d: StreamedDelta, token_ids: tuple[int, ...]) -> dict[str, Any]:
    """One delta of one choice as a websocket message: its answer text, and (chat) its reasoning and tool
    calls as OpenAI's chunks carry them; finish_reason as the HTTP APIs give it."""
    message: dict[str, Any] = {"type": "delta", "id": gid, "index": d.index, "text": d.text,
                               "token_ids": list(token_ids), "logprobs": d.logprobs,
                               "finish_reason": finish_reason(d.finish)}
    deltas = [delta for ev in d.events if (delta := event_delta(ev)) is not None]
    if reasoning := "".join(delta.get("reasoning", "") for delta in deltas):
        message["reasoning"] = reasoning
    if calls := [call for delta in deltas for call in delta.get("tool_calls", ())]:
        message["tool_calls"] = calls
    if d.prompt_logprobs is not None:
        message["prompt_logprobs"] = d.prompt_logprobs
    return message


GOING_AWAY = 1001  # the websocket close code of a server shutting down
CLOSE_FLUSH_S = 1.0  # at shutdown, how long the generations may take to send their error messages


async def _writer(out: trio.MemoryReceiveChannel[str | None], done: trio.CancelScope) -> None:
    """The socket's only sender; None (sent at shutdown, after every other message) closes the socket."""
    async with out:
        async for text in out:
            if text is None:
                await websocket.close(GOING_AWAY, "the server is shutting down")
                done.cancel()
                return
            await websocket.send(text)


async def _close_when_drained(session: _Session) -> None:
    # A graceful shutdown has ended every generation: each sends its error message, then the socket closes.
    await session.registry.wait_drained()
    session.emptied = trio.Event()
    with trio.move_on_after(CLOSE_FLUSH_S):
        if session.active:
            await session.emptied.wait()
    await session.out.send(None)


def register_websocket(app: QuartTrio, registry: ModelRegistry, config: ServerConfig) -> None:
    @app.websocket("/v1/ws")
    async def ws() -> None:
        # A browser fails the handshake unless the server selects one of the subprotocols it offered.
        await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in websocket.requested_subprotocols else None)
        send, recv = trio.open_memory_channel[str | None](256)
        async with trio.open_nursery() as nursery, send:
            nursery.start_soon(_writer, recv, nursery.cancel_scope)
            session = _Session(nursery, send, registry, config)
            nursery.start_soon(_close_when_drained, session)
            while True:  # ends when quart-trio cancels us on disconnect (or the writer closes the socket)
                await session.on_message(await websocket.receive())
