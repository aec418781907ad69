"""Short soak, overload and slow-client runs against a live server on the mock engine (the long versions are
`trillm bench soak`): nothing leaks, nobody gets a 5xx or a reset, one client cannot slow the others."""

from __future__ import annotations

import json
import random
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

from trillm.engine.config import EngineConfig

from conftest import MockFactory, burst_completions, running_server


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Tally:
    def __init__(self) -> None:
        self.done = 0
        self.disconnects = 0
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []

    def status(self, code: int) -> None:
        self.statuses[code] = self.statuses.get(code, 0) + 1


def body_for(rng: random.Random, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": rng.choice([4, 16, 48]), "n": rng.choice([1, 1, 2, 3]),
                            "temperature": rng.choice([0.0, 1.0]), "seed": i}
    if rng.random() < 0.5:
        body["stop"] = rng.sample([" a", " b", " ab", " zz", " q"], 2)  # some match early, some never
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": f"question {i} " * rng.randint(1, 30)}]
    else:
        body["prompt"] = f"prompt {i} " * rng.randint(1, 30)
    return body


async def one_sse(client: httpx.AsyncClient, body: dict[str, Any], cut: int | None, tally: Tally) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        tally.status(r.status_code)
        events = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if line == "data: [DONE]":
                    tally.done += 1
                    return
                if '"error"' in line:
                    tally.errors.append(line)
                if cut is not None and events >= cut:
                    tally.disconnects += 1
                    return  # leaving the block closes the connection mid-stream
    tally.errors.append("stream ended without [DONE]")


async def one_plain(client: httpx.AsyncClient, body: dict[str, Any], cut: float | None, tally: Tally) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with trio.move_on_after(cut if cut is not None else 60) as scope:
        r = await client.post(path, json=body)
        tally.status(r.status_code)
        if r.status_code == 200 and len(r.json()["choices"]) == body["n"]:
            tally.done += 1
        else:
            tally.errors.append(r.text[:200])
    if scope.cancelled_caught:
        tally.disconnects += 1


async def one_ws(url: str, rng: random.Random, i: int, tally: Tally) -> None:
    async with trio_websocket.open_websocket_url(url.replace("http", "ws", 1) + "/v1/ws") as ws:
        gids = [f"{i}-{k}" for k in range(rng.randint(1, 3))]
        for gid in gids:
            await ws.send_message(json.dumps({"type": "generate", "id": gid, **body_for(rng, i)}))
        cut = rng.random() < 0.3
        pending = set(gids)
        cancelled: set[str] = set()
        while pending:
            msg = json.loads(await ws.get_message())
            if msg["type"] == "delta" and cut:
                if rng.random() < 0.5:
                    cancelled.add(msg["id"])  # (it may finish before the cancel arrives: then the cancel is a 404)
                    await ws.send_message(json.dumps({"type": "cancel", "id": msg["id"]}))
                else:
                    tally.disconnects += 1
                    return  # close the socket with generations running
                cut = False
            elif msg["type"] in ("done", "cancelled"):
                pending.discard(msg["id"])
                tally.done += msg["type"] == "done"
                tally.disconnects += msg["type"] == "cancelled"
            elif msg["type"] == "error" and not (msg["id"] in cancelled and msg["error"]["code"] == "generation_not_found"):
                tally.errors.append(json.dumps(msg))
                pending.discard(msg["id"])


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 5) -> dict[str, Any]:
    """Until nothing is live, running or waiting and no KV block is held (GET /stats); that model's stats."""
    with trio.fail_after(timeout_s):
        while True:
            model = (await client.get("/stats")).json()["models"][0]
            engine = model["engine"]
            if model["live_requests"] == 0 and engine["running"] == engine["waiting"] == engine["kv_blocks_used"] == 0:
                return model
            await trio.sleep(0.02)


async def soak(url: str, seconds: float, clients: int, seed: int) -> Tally:
    tally = Tally()
    rng = random.Random(seed)
    deadline = trio.current_time() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        async def worker(w: int) -> None:
            i = 0
            while trio.current_time() < deadline:
                i += 1
                kind = rng.random()
                disconnect = rng.random() < 0.3
                body = body_for(rng, w * 100_000 + i)
                if kind < 0.45:
                    await one_sse(client, body, rng.randint(1, 6) if disconnect else None, tally)
                elif kind < 0.8:
                    await one_plain(client, body, rng.uniform(0.001, 0.05) if disconnect else None, tally)
                else:
                    await one_ws(url, rng, w * 100_000 + i, tally)

        async with trio.open_nursery() as nursery:
            for w in range(clients):
                nursery.start_soon(worker, w)
    return tally


async def test_soak_with_random_disconnects_leaks_nothing() -> None:
    factory = MockFactory(step_delay=0.002)
    async with running_server(factory) as serving, httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
        warm = await soak(serving.url, 2.0, 12, seed=1)
        await wait_idle(client)
        rss0 = rss_mb()
        tally = await soak(serving.url, 8.0, 12, seed=2)
        model = await wait_idle(client)
        growth = rss_mb() - rss0
    assert warm.done and tally.done > 100 and tally.disconnects > 20, vars(tally)
    assert not tally.errors, tally.errors[:5]
    assert set(tally.statuses) == {200}, tally.statuses
    assert model["restarts"] == 0 and model["requests"].get("error", 0) == 0
    assert model["requests"]["abort"] > 0  # the disconnects really aborted generations
    assert growth < 50, growth  # MB, after warm-up
    factory.engine.block_manager.check_invariants([])


async def test_overload_burst_gets_503_with_retry_after_and_throughput_recovers() -> None:
    cfg = EngineConfig(num_kv_blocks=512, max_num_seqs=4, max_num_batched_tokens=64, max_waiting=8)
    factory = MockFactory(config=cfg, step_delay=0.004)
    body = {"prompt": "hello there", "max_tokens": 24, "ignore_eos": True}
    async with running_server(factory) as serving, httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
        async def throughput(seconds: float) -> float:
            tokens = 0
            deadline = trio.current_time() + seconds

            async def loop() -> None:
                nonlocal tokens
                while trio.current_time() < deadline:
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200
                    tokens += r.json()["usage"]["completion_tokens"]

            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                for _ in range(4):  # as many as run at once: the engine's full rate
                    nursery.start_soon(loop)
            return tokens / (trio.current_time() - t0)

        before = await throughput(1.5)
        results = await burst_completions(serving.url, body, clients=10 * cfg.max_waiting)
        after = await throughput(1.5)
        await wait_idle(client)
    assert len(results) == 80 and all(results), "a connection was reset or closed without a response"
    ok = [r for r in results if r.startswith(b"HTTP/1.1 200")]
    refused = [r for r in results if r.startswith(b"HTTP/1.1 503")]
    assert len(ok) + len(refused) == 80 and len(refused) >= 80 - (cfg.max_waiting + cfg.max_num_seqs) - 8
    for r in refused:
        head, _, payload = r.partition(b"\r\n\r\n")
        assert b"\r\nretry-after: 1\r\n" in head.lower() and json.loads(payload)["error"]["code"] == "overloaded"
    assert after > 0.8 * before, (before, after)


async def test_a_slow_reader_and_a_stalled_reader_do_not_slow_the_others() -> None:
    """Inter-token latency of four ordinary streams, with two more ordinary streams beside them, then with a
    client that reads one event every 0.2 s and one that never reads (its socket buffer is tiny) instead."""
    # Long steps, so the box's own jitter (a shared 2-core machine) is small beside them.
    factory = MockFactory(step_delay=0.05)
    body = {"prompt": "steady", "max_tokens": 30, "ignore_eos": True, "stream": True}
    async with running_server(factory, service_config={"max_buffered_bytes": 32 << 10}) as serving:
        host, port = serving.url.removeprefix("http://").rsplit(":", 1)
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            async def timed() -> list[float]:
                gaps: list[float] = []
                last = None
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(now - last)
                            last = now
                return gaps

            # The stalled reader's request: 8 choices with 20 logprobs a token, so that the server's writes to
            # it block within the first second. The ordinary phase runs the same request, read promptly.
            heavy = {**body, "max_tokens": 300, "n": 8, "logprobs": 20}

            async def ordinary(request: dict[str, Any]) -> None:
                async with client.stream("POST", "/v1/completions", json=request) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():
                        pass

            async def slow() -> None:
                async with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 1000}) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():
                        await trio.sleep(0.2)

            async def stalled(done: trio.Event) -> None:
                sock = trio.socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                await sock.connect((host, int(port)))
                payload = json.dumps(heavy).encode()
                with sock:
                    await sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                                    b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                    await done.wait()  # never reads

            async def phase(extra: str) -> float:
                gaps: list[list[float]] = []
                done = trio.Event()
                async with trio.open_nursery() as nursery:
                    if extra == "ordinary":
                        nursery.start_soon(ordinary, {**body, "max_tokens": 1000})
                        nursery.start_soon(ordinary, heavy)
                    else:
                        nursery.start_soon(slow)
                        nursery.start_soon(stalled, done)
                    await trio.sleep(0.2)
                    async with trio.open_nursery() as measured:
                        for _ in range(4):
                            measured.start_soon(lambda: _append(gaps, timed()))
                    done.set()
                    nursery.cancel_scope.cancel()
                return statistics.median(g for one in gaps for g in one)

            ratios = []
            for _ in range(3):
                base = await phase("ordinary")
                hostile = await phase("slow and stalled")
                ratios.append(hostile / base)
            await wait_idle(client)
    print("inter-token latency ratios (slow and stalled readers / ordinary ones):", ratios)
    assert statistics.median(ratios) < 1.10, ratios
    assert serving.services[0].metrics.outcomes["error"] >= 1  # a stalled reader is cut off at its cap


async def _append(into: list[list[float]], coro: Any) -> None:
    into.append(await coro)
