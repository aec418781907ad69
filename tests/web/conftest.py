"""Fixtures for the web tests: EngineServices around the mock engine (the real LLMEngine, Scheduler and
BlockManager with a timing-model runner and a word tokenizer), and live servers."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
import trio.testing

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.mock import LinearCostModel, MockModelSpec, Recording, make_mock_engine
from trillm.engine.mock.tokenizer import MockTokenizer
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.tokenizer import SpecialTokens, TokenizerLike
from trillm.web.service.engine_service import EngineService, ServiceConfig

SPEC = MockModelSpec(name="mock-model", vocab_size=2000, max_model_len=2048)
TOKENIZER = MockTokenizer(SPEC.vocab_size)
DEFAULT_CONFIG = EngineConfig(num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=64)


class MockFactory:
    """Builds mock engines (on the engine thread) and remembers them, so tests can poke the live one.

    step_delay: each step takes that long, in real time (the engine thread sleeps).
    """

    def __init__(self, *, config: EngineConfig = DEFAULT_CONFIG, step_delay: float = 0.0, load_delay: float = 0.0,
                 spec: MockModelSpec = SPEC, recording: Recording | None = None,
                 tokenizer: TokenizerLike | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.perf = LinearCostModel(step_delay, 0.0, 0.0, step_delay, 0.0, 0.0)
        self.load_delay = load_delay
        self.spec = spec
        self.recording = recording
        self.engines: list[LLMEngine] = []
        self.threads: list[int] = []  # the thread each engine was built on

    def __call__(self) -> LLMEngine:
        time.sleep(self.load_delay)
        engine = make_mock_engine(self.config, spec=self.spec, perf=self.perf, recording=self.recording,
                                  sleep=time.sleep, tokenizer=self.tokenizer)
        self.engines.append(engine)
        self.threads.append(threading.get_ident())
        return engine

    @property
    def engine(self) -> LLMEngine:
        return self.engines[-1]

    def fail_next_step(self, message: str = "injected engine failure") -> None:
        """Make the live engine's next step raise (an attribute swap: atomic, so any thread may call it)."""
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(message)

        self.engine.runner.launch = broken  # type: ignore[method-assign]


class ByteTokenizer:
    """One token per UTF-8 byte (id = byte + 3; 0-2 are the mock's specials), so a Recording can spell any text."""

    vocab_size = 259
    eos_token_ids = frozenset({0, 2})
    bos_token_id = None
    special_tokens = SpecialTokens(eos_token="<|im_end|>", bos_token=None, pad_token=None, chat_template=None)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - 3]) if token_id >= 3 else b""

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def scripted(prompt_messages: list[dict[str, Any]], answer: str) -> MockFactory:
    """Mock engines that answer `prompt_messages` with exactly `answer` (then EOS)."""
    tok = ByteTokenizer()
    spec = MockModelSpec(name="mock-model", vocab_size=tok.vocab_size, max_model_len=2048)
    recording = Recording([(tok.apply_chat_template(prompt_messages), tok.encode(answer) + [2])])
    return MockFactory(spec=spec, recording=recording, tokenizer=tok)


def reference_text(prompt_ids: list[int], max_tokens: int, *, seed: int | None = None, spec: MockModelSpec = SPEC,
                   recording: Recording | None = None) -> str:
    """The independent truth for a mock engine's output: the same prompt run alone, offline."""
    engine = make_mock_engine(DEFAULT_CONFIG, spec=spec, recording=recording)
    (out,) = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True))
    return out.new_text


@asynccontextmanager
async def running_service(factory: Callable[[], Any], **config: Any) -> AsyncIterator[EngineService]:
    async with trio.open_nursery() as nursery:
        service = await nursery.start(EngineService(factory, config=ServiceConfig(**config)).run)
        yield service
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def running_app(factory: Callable[[], Any], *, service_config: dict[str, Any] | None = None,
                      **server: Any) -> AsyncIterator[Any]:
    """A quart test client on an app around one running service."""
    from trillm.web.app import create_app
    from trillm.web.config import ServerConfig

    async with running_service(factory, **(service_config or {})) as service:
        app = create_app([service], ServerConfig(**server))
        yield app.test_client()


def parse_sse(data: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body (JSON-decoded, except the final "[DONE]")."""
    import json

    events = []
    for block in data.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@asynccontextmanager
async def running_server(*factories: Callable[[], Any], service_config: dict[str, Any] | None = None,
                         **server: Any) -> AsyncIterator[Any]:
    """A live hypercorn server on 127.0.0.1 (a free port); yields trillm.web.server.Serving."""
    from trillm.web.config import ServerConfig
    from trillm.web.server import ModelSpec, serve

    config = ServerConfig(host="127.0.0.1", port=0, **server)
    async with trio.open_nursery() as nursery:
        serving = await nursery.start(partial(serve, [ModelSpec(None, f) for f in factories], config,
                                              service_config=ServiceConfig(**(service_config or {}))))
        yield serving
        nursery.cancel_scope.cancel()


async def read_to_eof(stream: trio.abc.Stream) -> bytes:
    chunks = []
    while data := await stream.receive_some(65536):
        chunks.append(data)
    return b"".join(chunks)


async def raw_http(url: str, request: bytes) -> bytes:
    """Send raw bytes to the server and read until it closes the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(request)
        return await read_to_eof(stream)


async def burst_completions(url: str, body: dict[str, Any], *, clients: int = 256, timeout_s: float = 30) -> list[bytes]:
    """`clients` raw HTTP/1.1 completion requests released at the same instant; their raw responses."""
    import json

    payload = json.dumps(body).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    gate = trio.Event()
    results: list[bytes] = []

    async def client() -> None:
        await gate.wait()
        results.append(await raw_http(url, request))

    with trio.fail_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(client)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    return results
