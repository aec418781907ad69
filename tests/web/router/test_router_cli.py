"""`trillm route` as a process in front of `trillm serve --mock` processes: one replica killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx

from trillm.bench.harness.servers import ServerProcess, free_port

SERVE = [sys.executable, "-m", "trillm.web.cli", "serve", "--mock", "--speedup", "20", "--max-num-seqs", "8",
         "--num-kv-blocks", "512"]


def test_route_command_survives_a_killed_replica(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    replicas = [ServerProcess(f"replica{i}", SERVE + ["--port", str(p)], p, tmp_path / f"replica{i}.log")
                for i, p in enumerate(ports)]
    rport = free_port()
    router = ServerProcess("router", [sys.executable, "-m", "trillm.web.cli", "route", "--port", str(rport),
                                      "--health-interval", "0.2", *(a for r in replicas for a in ("--replica", r.url))],
                           rport, tmp_path / "router.log")
    try:
        for proc in (*replicas, router):
            proc.start()
        for proc in (*replicas, router):
            proc.wait_ready(60)
        with httpx.Client(base_url=router.url, timeout=30) as client:
            for _ in range(100):  # both replicas in the pool, their KV-event streams started
                st = client.get("/stats").json()
                if all(rep["health"] == "healthy" and rep["workers"] and rep["workers"][0]["synced"]
                       for rep in st["replicas"]):
                    break
                time.sleep(0.1)
            system = {"role": "system", "content": "you answer questions about rivers " * 20}
            cached = []
            for i in range(4):
                r = client.post("/v1/chat/completions", json={"messages": [system, {"role": "user", "content": f"q{i}"}],
                                                              "max_tokens": 4})
                assert r.status_code == 200, r.text
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert cached[0] == 0 and min(cached[1:]) > 0  # the later ones followed the shared prefix
            assert replicas[0].proc is not None
            os.kill(replicas[0].proc.pid, signal.SIGKILL)
            replicas[0].proc.wait()
            for i in range(6):
                r = client.post("/v1/completions", json={"prompt": f"after the kill {i}", "max_tokens": 3})
                assert r.status_code == 200, r.text
            # The 6 requests may all have gone to the live replica; the next health check (0.2 s) sees the kill.
            deadline = time.monotonic() + 10
            while (health := client.get("/health").json())["replicas"][replicas[0].url]["health"] != "unhealthy":
                assert time.monotonic() < deadline, health
                time.sleep(0.05)
            assert health["status"] == "ok"
            assert client.get("/v1/models").json()["data"][0]["ready"] is True
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(20) == 0
    finally:
        for proc in (router, *replicas):
            proc.stop()
