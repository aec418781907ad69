"""`trillm route` live, over in-process `serve --mock` replicas on loopback: KV-aware routing against
round-robin on a multi-turn workload, byte-for-byte forwarding, retries (a full replica, a dead one, one
killed mid-run), health, the websocket, and how the router learns to hash and tokenize like its replicas."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio
import trio_websocket
from quart import Response
from quart_trio import QuartTrio

from conftest import scripted
from trillm.bench.harness.arrival import Arrival
from trillm.bench.harness.client import GenerationOptions, Target
from trillm.bench.harness.run import run_workload
from trillm.bench.harness.servers import free_port
from trillm.bench.harness.workloads import multi_turn
from trillm.engine.block_manager import root_hash
from trillm.engine.config import EngineConfig
from trillm.engine.mock import MockModelSpec, make_mock_engine, mock_model_id
from trillm.web.config import ServerConfig
from trillm.web.router.app import Routing, route
from trillm.web.router.config import RouterConfig
from trillm.web.server import ModelSpec, Serving, serve

SPEC = MockModelSpec(name="mock-model", vocab_size=2000, max_model_len=4096)
CONFIG = EngineConfig(num_kv_blocks=1024, max_num_seqs=16)


def mock_factory(config: EngineConfig = CONFIG, speedup: float = 50.0) -> Any:
    return lambda: make_mock_engine(config, spec=SPEC, speedup=speedup)


class Replica:
    """One in-process `serve --mock` replica that a test can kill (cancel) at any time."""

    def __init__(self, serving: Serving, scope: trio.CancelScope) -> None:
        self.serving = serving
        self.url = serving.url
        self.scope = scope

    def kill(self) -> None:
        self.scope.cancel()


async def start_replica(nursery: trio.Nursery, factory: Any = None, port: int = 0) -> Replica:
    async def run(task_status: trio.TaskStatus[Replica]) -> None:
        with trio.CancelScope() as scope:  # serve runs inside it, so that cancelling it kills the replica
            async with trio.open_nursery() as inner:
                serving = await inner.start(serve, [ModelSpec(None, factory or mock_factory(), inline=True)],
                                            ServerConfig(port=port))
                task_status.started(Replica(serving, scope))

    replica: Replica = await nursery.start(run)
    return replica


@asynccontextmanager
async def routing(urls: list[str], **config: Any) -> AsyncIterator[Routing]:
    config.setdefault("health_interval_s", 0.1)
    async with trio.open_nursery() as nursery:
        r: Routing = await nursery.start(partial(route, RouterConfig(tuple(urls), ServerConfig(port=0), **config)))
        yield r
        nursery.cancel_scope.cancel()


async def wait_synced(r: Routing, n: int, timeout: float = 10, *, hashed: bool = True) -> dict[str, Any]:
    """Until n workers are in the pool with their KV-event streams started (and, if `hashed`, their block
    hashing known and their tokenizers decided)."""
    async with httpx.AsyncClient(timeout=30) as client:
        with trio.fail_after(timeout):
            while True:
                st = (await client.get(r.url + "/stats")).json()
                ready = [w for rep in st["replicas"] if rep["health"] == "healthy" for w in rep["workers"]
                         if w["synced"] and (w["model_id"] is not None or not hashed)]
                decided = bool(st["tokenizers"]) and "checking" not in st["tokenizers"].values()
                if len(ready) >= n and (decided or not hashed):
                    return st  # type: ignore[no-any-return]
                await trio.sleep(0.02)


async def test_hello_says_how_the_replica_hashes_blocks() -> None:
    async with trio.open_nursery() as nursery:
        rep = await start_replica(nursery)
        ws_url = rep.url.replace("http", "ws", 1) + "/internal/kv-events"
        async with trio_websocket.open_websocket_url(ws_url) as ws, httpx.AsyncClient(timeout=30) as client:
            hello = json.loads(await ws.get_message())
            assert hello["model_id"] == mock_model_id(SPEC) and hello["block_size"] == CONFIG.block_size
            assert hello["hash_seed"] == root_hash(mock_model_id(SPEC)).hex() and hello["prefix_caching"] is True
            from trillm.web.router.core import Hello

            spec = Hello.from_json(hello).spec
            assert spec is not None
            body = {"messages": [{"role": "user", "content": "tell me " * 60}], "max_tokens": 2}
            ids = (await client.post(rep.url + "/tokenize", json=body)).json()["tokens"]
            assert (await client.post(rep.url + "/v1/chat/completions", json=body)).status_code == 200
            stored: set[str] = set()
            want = set(spec.matchable_hashes(ids))
            assert len(want) == (len(ids) - 1) // CONFIG.block_size > 0
            with trio.fail_after(5):
                while not want <= stored:  # the router's hashes of the prompt are the blocks the replica stored
                    msg = json.loads(await ws.get_message())
                    stored |= {e["block_hash"] for rep_ in msg["reports"] for e in rep_["kv_events"]
                               if e["kind"] == "stored"}
        nursery.cancel_scope.cancel()


async def run_multi_turn(policy: str) -> tuple[Any, dict[str, Any]]:
    # 7 conversations over 3 replicas: round-robin cannot keep a conversation on one replica by accident.
    workload = multi_turn(num_conversations=7, num_turns=4, user_len=48, assistant_len=24, output_len=6,
                          system_len=96, seed=3)
    async with trio.open_nursery() as nursery:
        replicas = [await start_replica(nursery) for _ in range(3)]
        async with routing([r.url for r in replicas], policy=policy) as r:
            await wait_synced(r, 3)
            result = await run_workload(Target(policy, r.url), workload, Arrival("concurrency", 7),
                                        GenerationOptions(ignore_eos=True, timeout_s=30), progress=False)
            async with httpx.AsyncClient(timeout=30) as client:
                stats = (await client.get(r.url + "/stats")).json()
        nursery.cancel_scope.cancel()
    return result, stats


async def test_kv_policy_gets_more_prefix_hits_than_round_robin_on_multi_turn() -> None:
    kv, kv_stats = await run_multi_turn("kv")
    rr, _ = await run_multi_turn("round-robin")
    for res in (kv, rr):
        assert all(rec.success for rec in res.records), [rec.error for rec in res.records if not rec.success]
    assert sorted(r.request_id for r in kv.records) == sorted(r.request_id for r in rr.records)
    assert kv.summary.input_tokens == rr.summary.input_tokens  # the same prompts, tokenized the same way

    def hit_rate(res: Any) -> float:
        return float(res.summary.cached_tokens / res.summary.input_tokens)

    assert hit_rate(kv) > 1.5 * hit_rate(rr), (hit_rate(kv), hit_rate(rr))
    assert kv_stats["tokenizers"] == {mock_model_id(SPEC): "local"}  # the mock's tokenizer, checked
    # The router expected (nearly) the hits the replicas then reported.
    predicted = kv_stats["predicted_cached_blocks"] * CONFIG.block_size
    assert 0.8 * predicted <= kv.summary.cached_tokens <= 1.2 * predicted + 64
    assert kv_stats["overhead"]["decisions"] == len(kv.records)


def fake_replica_app(chunks: list[bytes], status: int = 200) -> QuartTrio:
    """A replica that answers every POST with fixed bytes in fixed pieces (and enough of the rest of the API
    for the router to adopt it)."""
    app = QuartTrio(__name__)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "mock-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        async def body() -> AsyncIterator[bytes]:
            for c in chunks:
                yield c
                await trio.sleep(0.01)

        resp = Response(body(), status=status, content_type="text/event-stream", headers={"X-Replica": "fake"})
        resp.timeout = None
        return resp

    @app.post("/v1/completions")
    async def completions() -> Response:
        return Response(b"".join(chunks), status=status, content_type="application/json")

    @app.post("/v1/messages")  # an endpoint the router knows nothing about: forwarded as it is
    async def messages() -> Response:
        from quart import request

        return Response(b"echo:" + await request.get_data(), status=201, content_type="application/octet-stream",
                        headers={"X-Seen-Query": request.query_string.decode()})

    @app.websocket("/internal/kv-events")
    async def kv() -> None:
        await app_websocket_send({"type": "hello", "model": "mock-model", "epoch": 0})
        await trio.sleep_forever()

    return app


async def app_websocket_send(msg: dict[str, Any]) -> None:
    from quart import websocket

    await websocket.send(json.dumps(msg))


@asynccontextmanager
async def fake_replica(chunks: list[bytes], status: int = 200) -> AsyncIterator[str]:
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn_serve, fake_replica_app(chunks, status), config, mode="asgi"))
        yield binds[0]
        nursery.cancel_scope.cancel()


async def test_responses_are_forwarded_byte_for_byte() -> None:
    chunks = [b'data: {"a": 1}\n\n', b": keepalive\n\n", b'data: {"b": "\xc3\xa9', b'"}\n\n', b"data: [DONE]\n\n"]
    async with fake_replica(chunks) as url, routing([url]) as r, httpx.AsyncClient(timeout=30) as client:
        await wait_synced(r, 1, hashed=False)
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        got: list[bytes] = []
        async with client.stream("POST", r.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200 and resp.headers["x-replica"] == "fake"
            assert resp.headers["content-type"] == "text/event-stream"
            async for piece in resp.aiter_raw():
                got.append(piece)
        assert b"".join(got) == b"".join(chunks)
        assert len(got) > 1  # streamed as it came, not buffered into one piece
        resp2 = await client.post(r.url + "/v1/completions", json={"prompt": "x"})
        assert resp2.content == b"".join(chunks) and resp2.headers["content-length"] == str(len(resp2.content))
        assert len(resp2.headers.get_list("date")) == 1
        resp3 = await client.post(r.url + "/v1/messages?beta=true", content=b"\x00not json")
        assert (resp3.status_code, resp3.content, resp3.headers["x-seen-query"]) == (201, b"echo:\x00not json",
                                                                                     "beta=true")


async def test_a_full_replica_passes_requests_to_the_next() -> None:
    full = mock_factory(EngineConfig(num_kv_blocks=256, max_num_seqs=4, max_waiting=0))  # every request: 503
    async with trio.open_nursery() as nursery:
        busy = await start_replica(nursery, full)
        ok = await start_replica(nursery)
        async with routing([busy.url, ok.url], policy="round-robin") as r, httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 2)
            for i in range(4):
                resp = await client.post(r.url + "/v1/completions", json={"prompt": f"a b c {i}", "max_tokens": 3})
                assert resp.status_code == 200, resp.text
            stats = (await client.get(r.url + "/stats")).json()
            assert stats["retries"].get("503", 0) == 2  # round-robin offered half of them to the full one
            ws_url = r.url.replace("http", "ws", 1) + "/v1/ws"
            async with trio_websocket.open_websocket_url(ws_url) as ws:  # a refused generation moves too
                for i in range(2):
                    await ws.send_message(json.dumps({"type": "generate", "id": i, "prompt": "x y", "max_tokens": 2}))
                done: list[Any] = []
                with trio.fail_after(10):
                    while len(done) < 2:
                        msg = json.loads(await ws.get_message())
                        assert msg["type"] in ("delta", "done"), msg
                        if msg["type"] == "done":
                            done.append(msg["id"])
            stats = (await client.get(r.url + "/stats")).json()
            assert stats["retries"]["503"] == 3
        async with routing([busy.url], policy="round-robin") as r, httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 1)
            resp = await client.post(r.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 3})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "overloaded"
            assert "retry-after" in resp.headers
        nursery.cancel_scope.cancel()


async def test_a_dead_replica_leaves_the_pool_and_rejoins_when_it_is_back() -> None:
    port = free_port()
    down = f"http://127.0.0.1:{port}"
    async with trio.open_nursery() as nursery:
        up = await start_replica(nursery)
        async with routing([down, up.url], policy="round-robin") as r, httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 1)
            assert (await client.get(r.url + "/health")).json()["replicas"][down]["health"] == "unhealthy"
            for i in range(3):
                resp = await client.post(r.url + "/v1/completions", json={"prompt": f"x {i}", "max_tokens": 2})
                assert resp.status_code == 200
            await start_replica(nursery, port=port)
            await wait_synced(r, 2)
            routed = {rep["url"]: rep["routed"] for rep in (await client.get(r.url + "/stats")).json()["replicas"]}
            for i in range(4):
                resp = await client.post(r.url + "/v1/completions", json={"prompt": f"y {i}", "max_tokens": 2})
                assert resp.status_code == 200
            after = {rep["url"]: rep["routed"] for rep in (await client.get(r.url + "/stats")).json()["replicas"]}
            assert after[down] - routed[down] == 2  # back in the rotation
        nursery.cancel_scope.cancel()


async def test_a_replica_killed_mid_run_costs_no_request_that_had_not_started_streaming() -> None:
    slow = mock_factory(speedup=2.0)  # generations last long enough to be cut
    async with trio.open_nursery() as nursery:
        replicas = [await start_replica(nursery, slow) for _ in range(3)]
        async with routing([r.url for r in replicas], policy="round-robin") as r, \
                httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 3)
            outcomes: list[tuple[str, bool, bool, float]] = []  # (kind, ok, had streamed bytes, start time)
            killed_at: list[float] = []

            async def one(i: int) -> None:
                stream = i % 2 == 0
                body = {"prompt": f"request {i} " + "word " * 30, "max_tokens": 40, "ignore_eos": True,
                        "stream": stream}
                start = trio.current_time()
                streamed = False
                try:
                    async with client.stream("POST", r.url + "/v1/completions", json=body) as resp:
                        ok = resp.status_code == 200
                        data = b""
                        async for piece in resp.aiter_raw():
                            streamed = True
                            data += piece
                    ok = ok and (b'"error"' not in data) and (not stream or data.endswith(b"data: [DONE]\n\n"))
                except httpx.HTTPError:
                    ok = False
                outcomes.append(("stream" if stream else "json", ok, streamed, start))

            async with trio.open_nursery() as clients:
                for i in range(36):
                    clients.start_soon(one, i)
                    await trio.sleep(0.02)
                    if i == 15:
                        replicas[1].kill()
                        killed_at.append(trio.current_time())
            health = (await client.get(r.url + "/health")).json()
            retries = (await client.get(r.url + "/stats")).json()["retries"]
        nursery.cancel_scope.cancel()
    assert len(outcomes) == 36
    failed = [o for o in outcomes if not o[1]]
    assert all(kind == "stream" and streamed for kind, _, streamed, _ in failed), failed
    assert all(ok for kind, ok, _, _ in outcomes if kind == "json")
    assert all(ok for _, ok, _, start in outcomes if start > killed_at[0] + 0.01)
    assert retries.get("dropped", 0) >= 1  # requests cut before their response started were moved
    assert health["replicas"][replicas[1].url]["health"] == "unhealthy"
    assert health["status"] == "ok"


async def test_websocket_generations_are_routed_and_cancellable() -> None:
    async with trio.open_nursery() as nursery:
        replicas = [await start_replica(nursery) for _ in range(2)]
        async with routing([r.url for r in replicas]) as r:
            await wait_synced(r, 2)
            ws_url = r.url.replace("http", "ws", 1) + "/v1/ws"
            async with trio_websocket.open_websocket_url(ws_url) as ws:
                system = "shared words " * 40
                for i in range(4):
                    await ws.send_message(json.dumps({"type": "generate", "id": i, "max_tokens": 5,
                                                      "messages": [{"role": "system", "content": system},
                                                                   {"role": "user", "content": f"q {i}"}]}))
                await ws.send_message(json.dumps({"type": "generate", "id": "long", "prompt": "go",
                                                  "max_tokens": 2000, "ignore_eos": True}))
                await ws.send_message("not json")
                await ws.send_message(json.dumps({"type": "cancel", "id": "nobody"}))
                done: dict[Any, Any] = {}
                errors: list[Any] = []
                deltas: dict[Any, int] = {}
                with trio.fail_after(20):
                    while len(done) < 5:
                        msg = json.loads(await ws.get_message())
                        if msg["type"] == "delta":
                            deltas[msg["id"]] = deltas.get(msg["id"], 0) + 1
                            if msg["id"] == "long" and deltas["long"] == 3:
                                await ws.send_message(json.dumps({"type": "cancel", "id": "long"}))
                        elif msg["type"] in ("done", "cancelled"):
                            done[msg["id"]] = msg
                        elif msg["type"] == "error":
                            errors.append(msg)
                assert [done[i]["type"] for i in range(4)] == ["done"] * 4 and done["long"]["type"] == "cancelled"
                assert [deltas[i] for i in range(4)] == [5] * 4 and deltas["long"] < 2000
                assert sorted(e["error"]["message"][:6] for e in errors) == ["no run", "the me"]
                # The shared system prompt was cached where the first one ran, and the rest followed it.
                assert sum(done[i]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(4)) > 0
            async with httpx.AsyncClient(timeout=30) as client:
                stats = (await client.get(r.url + "/stats")).json()
            assert all(w["inflight"] == 0 for rep in stats["replicas"] for w in rep["workers"])
        nursery.cancel_scope.cancel()


async def test_a_replica_whose_tokenizer_differs_is_tokenized_remotely() -> None:
    messages = [{"role": "user", "content": "hello"}]
    async with trio.open_nursery() as nursery:
        rep = await start_replica(nursery, scripted(messages, "Hi there!"))  # a byte tokenizer, mock model id
        async with routing([rep.url]) as r, httpx.AsyncClient(timeout=30) as client:
            st = await wait_synced(r, 1)
            (state,) = st["tokenizers"].values()
            assert state == "remote"
            resp = await client.post(r.url + "/v1/chat/completions", json={"messages": messages})
            assert resp.json()["choices"][0]["message"]["content"] == "Hi there!"
            stats = (await client.get(r.url + "/stats")).json()
            assert stats["overhead"]["tokenized"] == 1 and stats["prompt_blocks"] > 0
        nursery.cancel_scope.cancel()


async def test_a_replica_engine_restart_resyncs_its_index() -> None:
    from conftest import MockFactory
    from trillm.web.service.engine_service import ServiceConfig

    factory = MockFactory(config=CONFIG)  # the threaded shell, so a failed step restarts the engine
    async with trio.open_nursery() as nursery:
        serving = await nursery.start(partial(serve, [ModelSpec(None, factory)], ServerConfig(port=0),
                                              service_config=ServiceConfig(restart_backoff_s=0.05)))
        async with routing([serving.url]) as r, httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 1)
            body = {"prompt": "some words to cache " * 10, "max_tokens": 2}
            assert (await client.post(r.url + "/v1/completions", json=body)).status_code == 200

            async def worker() -> dict[str, Any]:
                st = (await client.get(r.url + "/stats")).json()
                return st["replicas"][0]["workers"][0]  # type: ignore[no-any-return]

            with trio.fail_after(5):
                while (await worker())["index_blocks"] == 0:
                    await trio.sleep(0.02)
            factory.fail_next_step()
            assert (await client.post(r.url + "/v1/completions", json=body)).status_code == 500
            with trio.fail_after(10):
                while (w := await worker())["epoch"] != 2 or not w["synced"]:
                    await trio.sleep(0.02)
            assert w["resyncs"] >= 1 and w["index_blocks"] == 0  # the new engine's cache is empty
            await wait_synced(r, 1)  # and the replica back in the pool
            assert (await client.post(r.url + "/v1/completions", json=body)).status_code == 200
            with trio.fail_after(5):
                while (await worker())["index_blocks"] == 0:  # and its new events fill the index again
                    await trio.sleep(0.02)
        nursery.cancel_scope.cancel()


async def test_api_keys_on_the_front_and_towards_the_replicas() -> None:
    async with trio.open_nursery() as nursery:
        serving = await nursery.start(serve, [ModelSpec(None, mock_factory(), inline=True)],
                                      ServerConfig(port=0, api_key="user-key", internal_api_key="replica-key"))
        # the router's own key (--internal-api-key there): the replica's API users never see its block hashes
        config = RouterConfig((serving.url,), ServerConfig(port=0, api_key="front-key"),
                              replica_api_key="replica-key", health_interval_s=0.1)
        async with trio.open_nursery() as inner:
            r: Routing = await inner.start(partial(route, config))
            await wait_synced(r, 1)  # the monitor reached /v1/models and /internal/kv-events with its key
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"prompt": "a b c", "max_tokens": 2}
                assert (await client.post(r.url + "/v1/completions", json=body)).status_code == 401
                resp = await client.post(r.url + "/v1/completions", json=body,
                                         headers={"Authorization": "Bearer front-key"})
                assert resp.status_code == 200, resp.text
                assert (await client.get(r.url + "/health")).status_code == 200  # open, as on a replica
            ws_url = r.url.replace("http", "ws", 1) + "/v1/ws"
            async with trio_websocket.open_websocket_url(
                    ws_url, extra_headers=[(b"Authorization", b"Bearer front-key")]) as ws:
                await ws.send_message(json.dumps({"type": "generate", "id": 1, "prompt": "x", "max_tokens": 2}))
                with trio.fail_after(10):
                    while json.loads(await ws.get_message())["type"] != "done":
                        pass
            inner.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_real_replicas_a_conversation_follows_its_prefix(tiny_model_path: Any) -> None:
    """Two replicas of the real engine (the tiny random llama, its HF tokenizer): with the model's tokenizer
    loaded in the router (and checked against the replicas') each turn goes where the previous one is
    cached; with the replicas' /tokenize instead, the same."""
    from trillm.web.service.engine_service import ServiceConfig

    def factory() -> Any:
        from trillm.engine.llm_engine import LLMEngine

        return LLMEngine(EngineConfig(model=str(tiny_model_path), num_kv_blocks=256, max_num_seqs=4,
                                      max_num_batched_tokens=128))

    async with trio.open_nursery() as nursery:
        replicas = [await nursery.start(partial(serve, [ModelSpec(None, factory)], ServerConfig(port=0),
                                                service_config=ServiceConfig())) for _ in range(2)]
        for tokenizer, state in ((str(tiny_model_path), "local"), ("remote", "remote")):
            async with routing([s.url for s in replicas], tokenizer=tokenizer) as r, \
                    httpx.AsyncClient(timeout=60) as client:
                st = await wait_synced(r, 2)
                assert list(st["tokenizers"].values()) == [state]
                messages: list[dict[str, str]] = [{"role": "system", "content": f"{tokenizer}: " + "be kind. " * 30}]
                cached = []
                for turn in range(3):
                    messages.append({"role": "user", "content": f"question number {turn} " * 4})
                    resp = await client.post(r.url + "/v1/chat/completions",
                                             json={"messages": messages, "max_tokens": 3, "temperature": 0})
                    assert resp.status_code == 200, resp.text
                    body = resp.json()
                    cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                routed = sorted(rep["routed"] for rep in (await client.get(r.url + "/stats")).json()["replicas"])
                assert cached[0] == 0 and min(cached[1:]) > 0, cached
                assert routed == [0, 3]  # the whole conversation on one replica
        nursery.cancel_scope.cancel()


async def test_messages_and_responses_apis_are_routed_by_their_prompt() -> None:
    """Anthropic's Messages and OpenAI's Responses requests: the router translates them as the replicas do
    (to a chat request) to hash their prompts, locally and through a replica's /tokenize alike."""
    from trillm.engine.mock import MockTokenizer
    from trillm.web.router.prompt import local_prompt_ids, tokenize_request

    system = "you know a lot about rivers " * 20
    bodies = {
        "messages": {"model": "mock-model", "max_tokens": 4, "system": system,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "the longest?"}]}]},
        "responses": {"model": "mock-model", "max_output_tokens": 4, "instructions": system, "input": "the longest?"},
    }
    async with trio.open_nursery() as nursery:
        replicas = [await start_replica(nursery) for _ in range(2)]
        async with routing([r.url for r in replicas]) as r, httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 2)
            for kind, body in bodies.items():
                local = local_prompt_ids(kind, body, MockTokenizer(SPEC.vocab_size))  # type: ignore[arg-type]
                payload = tokenize_request(kind, body, "mock-model")  # type: ignore[arg-type]
                remote = (await client.post(replicas[0].url + "/tokenize", json=payload)).json()["tokens"]
                assert local is not None and local == remote
            path = {"messages": "/v1/messages", "responses": "/v1/responses"}
            for kind, body in bodies.items():
                for turn in range(2):
                    resp = await client.post(r.url + path[kind], json=body)
                    assert resp.status_code == 200, resp.text
            stats = (await client.get(r.url + "/stats")).json()
            # Both translate to the same chat prompt (system + user), so every request after the first found
            # it where the router had sent the first.
            assert stats["predicted_cached_blocks"] >= 3 * (len(system.split()) // CONFIG.block_size)
            assert sorted(rep["routed"] for rep in stats["replicas"]) == [0, 4]
            # The router's own errors take the API's shape: Anthropic's on /v1/messages.
        async with routing(["http://127.0.0.1:1"]) as r, httpx.AsyncClient(timeout=30) as client:
            resp = await client.post(r.url + "/v1/messages", json=bodies["messages"])
            assert resp.status_code == 503 and resp.json()["type"] == "error"
        nursery.cancel_scope.cancel()
