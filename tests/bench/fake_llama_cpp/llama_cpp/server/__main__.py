"""`python -m llama_cpp.server` stand-in: takes llama-cpp-python's flags (only those), insists on an all-F32
GGUF and `--interrupt_requests False`, then streams like llama.cpp's server does: one request at a time,
/v1/models for health, no usage in the stream."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/bench: bench_standin
from bench_standin import StandIn  # noqa: E402

from gguf import GGMLQuantizationType, GGUFReader  # noqa: E402


class OneAtATime(StandIn):
    lock: trio.Lock | None = None

    async def _respond(self, stream: trio.SocketStream, head: bytes, body: bytes) -> None:
        if self.lock is None:
            self.lock = trio.Lock()
        if body:  # llama.cpp ignores stream_options: no usage chunk
            req = json.loads(body)
            req.pop("stream_options", None)
            body = json.dumps(req).encode()
        async with self.lock:
            await super()._respond(stream, head, body)


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--port", "--n_ctx", "--n_threads", "--n_threads_batch",
                 "--interrupt_requests"):
        p.add_argument(flag, required=True)
    args = p.parse_args()
    assert args.interrupt_requests == "False", args.interrupt_requests
    reader = GGUFReader(args.model)
    types = {t.tensor_type for t in reader.tensors}
    assert types == {GGMLQuantizationType.F32}, types
    standin = OneAtATime(ttft_s=0.01, itl_s=0.002)

    async def serve() -> None:
        await trio.serve_tcp(standin.handle_http, int(args.port), host=args.host)

    print(f"stand-in llama.cpp on {args.host}:{args.port} with {args.model}", flush=True)
    trio.run(serve)


if __name__ == "__main__":
    main()
