"""A bare hypercorn-trio SSE server that streams the same events as trillm, with nothing else in the way.

POST /v1/completions {"max_tokens": N, ...} answers N OpenAI-style completion chunks (the size of trillm's,
text from the mock tokenizer's vocabulary) and `data: [DONE]`, as fast as hypercorn sends them (each send is
a trio checkpoint), or one every --step-ms. It is the ceiling for trillm's web layer: the target is for
`trillm serve --mock` to deliver at least 0.8x its events/s (measure both with bench/harness/sse_load.py).

    .venv/bin/python -m trillm.bench.harness.sse_baseline --port 8100
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from trillm.engine.mock.tokenizer import MockTokenizer

_TOK = MockTokenizer(49152)


def chunk(i: int, rid: str, created: int, finish: str | None) -> bytes:
    text = _TOK.decode([3 + (i * 7919) % 49000])
    body = {"id": rid, "object": "text_completion", "created": created, "model": "baseline",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def make_app(step_s: float) -> Any:
    counter = iter(range(1 << 62))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        n = int(json.loads(body or b"{}").get("max_tokens", 16))
        rid, created = f"cmpl-{next(counter)}", int(time.time())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for i in range(n):
            if step_s:
                await trio.sleep(step_s)
            await send({"type": "http.response.body", "body": chunk(i, rid, created, "length" if i == n - 1 else None),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sse_baseline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--step-ms", type=float, default=0.0, help="delay before each event (0: as fast as possible)")
    args = p.parse_args(argv)
    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.backlog = 4096
    config.accesslog = None
    print(f"SSE baseline on http://{args.host}:{args.port}/v1/completions", flush=True)
    try:
        trio.run(partial(serve, make_app(args.step_ms / 1000), config, mode="asgi"))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
