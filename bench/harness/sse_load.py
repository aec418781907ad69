"""Load an SSE server with many concurrent streams from a separate process (loopback only, bounded).

Each stream is one raw HTTP/1.1 POST on its own TCP connection (trio sockets, no HTTP library), counting
`data: ` events until `data: [DONE]`: cheap enough that the server, not the client, is what is measured.

Modes:
  --duration S   closed loop: --streams workers each send request after request for S seconds; reports
                 events/s (compare `trillm serve --mock --speedup 1e9` with bench/harness/sse_baseline.py).
  (default)      --streams requests opened at once, each held to the end: reports how many were open
                 together, errors, and (with --server-pid) the server's RSS before, at the peak, and after.
--hold-first N waits until N streams have their response headers (then samples memory) before any reads:
idle streams cost what a queued request costs.
--httpx-connections N sends the --streams requests at once through one httpx client with a pool of N
keep-alive connections (as SDKs do), so connections are reused: errors count what the client saw, e.g.
"closed-without-response" for a reused connection the server closed as the next request arrived.

    .venv/bin/python -m trillm.bench.harness.sse_load --url http://127.0.0.1:8000 --streams 2000 --max-tokens 32
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import trio

MAX_STREAMS = 5000
MAX_DURATION_S = 600.0


@dataclass
class Tally:
    started: int = 0
    headers: int = 0  # streams that got their response headers
    open_now: int = 0
    peak_open: int = 0
    connected_now: int = 0  # TCP connections up, stream not finished (queued requests included)
    peak_connected: int = 0
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    events: int = 0
    ttft: list[float] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def one_stream(host: str, port: int, path: str, body: bytes, tally: Tally,
                     headers_seen: trio.Event | None = None, release: trio.Event | None = None) -> None:
    tally.started += 1
    t0 = time.perf_counter()
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        tally.error(f"connect:{exc.errno}")
        return
    tally.connected_now += 1
    tally.peak_connected = max(tally.peak_connected, tally.connected_now)
    async with stream:
        req = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
        try:
            await stream.send_all(req)
            buf = b""
            got_headers = False
            tail = b""
            first = True
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    tally.error("closed-early")
                    return
                if not got_headers:
                    buf += data
                    if b"\r\n\r\n" not in buf:
                        continue
                    head, _, data = buf.partition(b"\r\n\r\n")
                    if not head.startswith(b"HTTP/1.1 200"):
                        tally.error(head.split(b"\r\n", 1)[0].decode(errors="replace")[9:12] or "bad-status")
                        return
                    got_headers = True
                    tally.headers += 1
                    tally.open_now += 1
                    tally.peak_open = max(tally.peak_open, tally.open_now)
                    if headers_seen is not None and release is not None:
                        headers_seen.set()
                        await release.wait()
                scan = tail + data
                n = scan.count(b"data: ")
                if n and first:
                    tally.ttft.append(time.perf_counter() - t0)
                    first = False
                if b"data: [DONE]" in scan:
                    tally.events += n - 1
                    tally.completed += 1
                    tally.open_now -= 1
                    return
                tally.events += n
                tail = scan[-11:] if not scan.endswith(b"data: ") else b""  # a marker split across reads
        except OSError as exc:
            tally.error(f"io:{exc.errno}")
        finally:
            tally.connected_now -= 1


async def httpx_streams(url: str, path: str, body: bytes, streams: int, connections: int, tally: Tally) -> None:
    """Every stream at once through one pooled httpx client; each counted like one_stream's."""
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one() -> None:
            tally.started += 1
            t0 = time.perf_counter()
            try:
                async with client.stream("POST", path, content=body,
                                         headers={"Content-Type": "application/json"}) as r:
                    if r.status_code != 200:
                        tally.error(str(r.status_code))
                        await r.aread()
                        return
                    tally.headers += 1
                    first = True
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if first:
                            tally.ttft.append(time.perf_counter() - t0)
                            first = False
                        if line == "data: [DONE]":
                            tally.completed += 1
                            return
                        tally.events += 1
                    tally.error("no-done")
            except httpx.RemoteProtocolError:
                tally.error("closed-without-response")
            except httpx.TransportError as exc:
                tally.error(type(exc).__name__)

        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one)


def check_loopback(url: str) -> tuple[str, int, str]:
    u = urlsplit(url)
    host = u.hostname or "127.0.0.1"
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit("sse_load only loads loopback servers")
    return host, u.port or 80, (u.path.rstrip("/") or "") + "/v1/completions"


async def run(args: argparse.Namespace) -> dict[str, object]:
    host, port, path = check_loopback(args.url)
    body = json.dumps({"prompt": "hello " * args.prompt_words, "max_tokens": args.max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    tally = Tally()
    rss0 = rss_mb(args.server_pid)
    samples: list[float] = []
    t0 = time.perf_counter()
    result: dict[str, object] = {}
    if args.httpx_connections:
        await httpx_streams(f"http://{host}:{port}", path, body, args.streams, args.httpx_connections, tally)
    elif args.duration:
        deadline = t0 + args.duration

        async def worker() -> None:
            while time.perf_counter() < deadline:
                await one_stream(host, port, path, body, tally)

        async with trio.open_nursery() as nursery:
            for _ in range(args.streams):
                nursery.start_soon(worker)
    else:
        release = trio.Event()
        hold = args.hold_first or 0

        async def held(i: int) -> None:
            seen = trio.Event() if i < hold else None
            await one_stream(host, port, path, body, tally, seen, release if seen is not None else None)

        async def sampler() -> None:
            while True:
                if (r := rss_mb(args.server_pid)) is not None:
                    samples.append(r)
                await trio.sleep(0.25)

        async with trio.open_nursery() as nursery:
            if args.server_pid:
                nursery.start_soon(sampler)
            with trio.move_on_after(args.timeout) as timed_out:
                async with trio.open_nursery() as streams:
                    for i in range(args.streams):
                        streams.start_soon(held, i)
                        if i % 100 == 99:
                            await trio.sleep(0)  # let the accept queue drain while connecting
                    if hold:
                        with trio.move_on_after(120):
                            while tally.headers < hold:
                                await trio.sleep(0.1)
                        await trio.sleep(1.0)
                        result["held_streams"] = tally.headers
                        result["rss_mb_held"] = rss_mb(args.server_pid)
                        release.set()
            result["timed_out"] = timed_out.cancelled_caught  # streams still open were disconnected
            nursery.cancel_scope.cancel()
    elapsed = time.perf_counter() - t0
    await trio.sleep(args.settle_s)
    ttft = sorted(tally.ttft)
    result.update({
        "streams": args.streams, "max_tokens": args.max_tokens, "elapsed_s": elapsed,
        "completed": tally.completed, "errors": tally.errors, "events": tally.events,
        "events_per_s": tally.events / elapsed if elapsed else 0.0,
        # servers differ in framing (trillm adds a finish chunk): compare the tokens they delivered
        "token_events_per_s": tally.completed * args.max_tokens / elapsed if elapsed else 0.0,
        "peak_open_streams": tally.peak_open, "peak_connected_streams": tally.peak_connected,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "ttft_max_s": ttft[-1] if ttft else None,
        "rss_mb_before": rss0, "rss_mb_peak": max(samples) if samples else None,
        "rss_mb_after": rss_mb(args.server_pid),
    })
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sse_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--duration", type=float, default=None, help="closed loop for this many seconds")
    p.add_argument("--hold-first", type=int, default=None, help="hold N streams idle after their headers")
    p.add_argument("--httpx-connections", type=int, default=None,
                   help="all streams at once through one httpx client with this many pooled connections")
    p.add_argument("--server-pid", type=int, default=None, help="sample this server's RSS")
    p.add_argument("--settle-s", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300.0, help="disconnect every stream after this long")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if not 1 <= args.streams <= MAX_STREAMS:
        raise SystemExit(f"--streams must be in [1, {MAX_STREAMS}]")
    if args.duration is not None and not 0 < args.duration <= MAX_DURATION_S:
        raise SystemExit(f"--duration must be in (0, {MAX_DURATION_S}]")
    res = trio.run(run, args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
