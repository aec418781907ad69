"""The hostile mix of `trillm bench soak --hostile N`: clients that try to hurt the well-behaved ones.

Each hostile client loops over five kinds of request:
- oversized bodies of every API, their bulk not message content (chat `tool_calls[].function.arguments`,
  Anthropic `tool_use.input`, Responses `function_call.arguments`): each must get a 400 (--max-prompt-bytes);
- a fan-out: one /v1/completions batch of prompts x n up to the server's --max-engine-requests, streamed;
- a special-token flood: a chat request whose `logit_bias` forces a special token (it decodes to nothing, the
  detokenizer's worst case), a long max_tokens and n > 1, streamed.
Hostile responses are read and dropped (never parsed: the client's CPU is the server's on a small machine).
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

OVERSIZED = ("oversized_chat", "oversized_messages", "oversized_responses")
KINDS = (*OVERSIZED, "fanout", "flood")
# A special token that is not an end of generation in SmolLM2's vocabulary and the mock's: <|im_start|>.
SPECIAL_TOKEN_ID = 1


@dataclass
class HostileTally:
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    transport_errors: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {"statuses": {k: dict(v) for k, v in self.statuses.items()},
                "requests": sum(sum(v.values()) for v in self.statuses.values()),
                "transport_errors": dict(self.transport_errors)}


@dataclass(frozen=True)
class HostileMix:
    model: str  # the served model's name (Messages and Responses require one)
    oversized_bytes: int  # over --max-prompt-bytes, under --max-request-bytes
    fanout_prompts: int
    fanout_n: int
    fanout_max_tokens: int
    flood_max_tokens: int
    flood_n: int

    def bodies(self) -> dict[str, tuple[str, bytes]]:
        """(path, encoded body) per oversized kind: encoded once, so the client spends no CPU on them."""
        blob = json.dumps({"a": "x" * self.oversized_bytes})
        obj = {f"k{i}": "v" * 24 for i in range(self.oversized_bytes // 32)}  # many keys: costly to parse
        chat = {"max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": blob}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "go"}]}
        messages = {"model": self.model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": obj}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}
        responses = {"model": self.model, "max_output_tokens": 4, "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": blob},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}
        return {"oversized_chat": ("/v1/chat/completions", json.dumps(chat).encode()),
                "oversized_messages": ("/v1/messages", json.dumps(messages).encode()),
                "oversized_responses": ("/v1/responses", json.dumps(responses).encode())}

    def fanout(self, rng: random.Random) -> dict[str, Any]:
        prompts = [f"fan out {i} " + " ".join(rng.choice("abcdefgh") for _ in range(8))
                   for i in range(self.fanout_prompts)]
        return {"prompt": prompts, "n": self.fanout_n, "max_tokens": self.fanout_max_tokens, "temperature": 1.0,
                "stream": True}

    def flood(self) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "say nothing"}], "n": self.flood_n,
                "max_tokens": self.flood_max_tokens, "temperature": 1.0, "stream": True,
                "logit_bias": {str(SPECIAL_TOKEN_ID): 100}}


async def _drain(client: httpx.AsyncClient, path: str, body: dict[str, Any] | bytes, codes: Counter[int]) -> None:
    """Counts the status as soon as it arrives (a long stream cut off at the deadline still counts), then
    reads the body to its end."""
    kwargs: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    async with client.stream("POST", path, **kwargs) as r:
        codes[r.status_code] += 1
        async for _ in r.aiter_raw():
            pass


async def hostile_clients(url: str, mix: HostileMix, clients: int, tally: HostileTally, deadline: float,
                          seed: int) -> None:
    """`clients` loops of hostile requests until `deadline` (trio clock); whatever runs then is cut off."""
    oversized = mix.bodies()
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        async def worker(k: int) -> None:
            # Each round: the three oversized bodies (quick 400s), then one long request, fan-out and flood
            # by turns; client k starts on kind k % 2, so with two clients both run from the start.
            for i in itertools.count():
                for kind in (*OVERSIZED, ("fanout", "flood")[(k + i) % 2]):
                    if trio.current_time() >= deadline:
                        return
                    await one(kind)

        async def one(kind: str) -> None:
            codes = tally.statuses[kind]
            try:
                if kind in oversized:
                    await _drain(client, *oversized[kind], codes)
                elif kind == "fanout":
                    await _drain(client, "/v1/completions", mix.fanout(rng), codes)
                else:
                    await _drain(client, "/v1/chat/completions", mix.flood(), codes)
            except (httpx.TransportError, OSError) as exc:
                tally.transport_errors[type(exc).__name__] += 1

        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                for k in range(clients):
                    nursery.start_soon(worker, k)


def hostile_missed(summary: dict[str, Any]) -> list[str]:
    """What the server got wrong with the hostile requests: an oversized body not refused with 400, a
    fan-out or flood within the caps refused or failed (5xx, 4xx)."""
    missed = []
    for kind, codes in summary["statuses"].items():
        wrong = {c: n for c, n in codes.items() if c != (400 if kind in OVERSIZED else 200)}
        if wrong:
            missed.append(f"hostile {kind}: unexpected statuses {wrong}")
    return missed
