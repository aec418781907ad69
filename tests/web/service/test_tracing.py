"""OpenTelemetry spans per request (queue, prefill, decode, stream) under the caller's W3C traceparent,
collected by the SDK's in-memory exporter (no network)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from trillm.web.service import tracing  # noqa: E402
from trillm.web.http.keys import parse_key_file  # noqa: E402

from conftest import MockFactory, parse_sse, running_app  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    out = {s.name: s for s in finished}
    assert len(out) == len(finished), [s.name for s in finished]
    return out


async def test_spans_per_phase_under_the_callers_traceparent(spans: InMemorySpanExporter) -> None:
    async with running_app(MockFactory()) as client:
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
        assert r.status_code == 200
    s = by_name(spans.get_finished_spans())
    assert set(s) == {"llm.request", "queue", "prefill", "decode", "stream"}
    root = s["llm.request"]
    assert root.kind is SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACE_ID  # the caller's trace...
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID  # ...under its span
    for name in ("queue", "prefill", "decode", "stream"):
        assert s[name].parent is not None and s[name].parent.span_id == root.context.span_id
        assert s[name].context.trace_id == root.context.trace_id
        assert root.start_time <= s[name].start_time <= s[name].end_time <= root.end_time, name
    assert s["queue"].end_time == s["prefill"].start_time  # the phases follow each other
    assert s["prefill"].end_time == s["decode"].start_time
    attrs = root.attributes
    assert attrs["gen_ai.request.model"] == "mock-model" and attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.usage.output_tokens"] == 5 and attrs["gen_ai.usage.input_tokens"] > 0
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert attrs["http.route"] == "/v1/chat/completions"


async def test_a_stream_and_a_request_without_traceparent(spans: InMemorySpanExporter) -> None:
    async with running_app(MockFactory()) as client:
        r = await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 3, "n": 2, "stream": True})
        assert parse_sse(await r.get_data())[-1] == "[DONE]"
    s = by_name(spans.get_finished_spans())
    root = s["llm.request"]
    assert root.parent is None  # a new trace
    assert len(root.attributes["trillm.request_ids"]) == 2  # n = 2: one span set for both
    assert root.attributes["gen_ai.usage.output_tokens"] == 6 and root.attributes["trillm.stream"] is True
    assert s["stream"].end_time <= root.end_time


async def test_refused_requests_end_their_span_with_an_error(spans: InMemorySpanExporter) -> None:
    async with running_app(MockFactory()) as client:
        r = await client.post("/v1/completions", json={"prompt": "q " * 3000}, headers={"traceparent": TRACEPARENT})
        assert r.status_code == 400
    (root,) = spans.get_finished_spans()
    assert root.name == "llm.request" and not root.status.is_ok and root.events[0].name == "exception"


async def test_the_key_name_never_the_key(spans: InMemorySpanExporter) -> None:
    secret = "sk-carol-123456789"
    keys = tuple(parse_key_file(f"carol {secret}"))
    async with running_app(MockFactory(), api_keys=keys) as client:
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 200
    root = by_name(spans.get_finished_spans())["llm.request"]
    assert root.attributes["trillm.api_key.name"] == "carol"
    assert all(secret not in str(v) for sp in spans.get_finished_spans() for v in (sp.attributes or {}).values())


async def test_off_by_default() -> None:
    assert not tracing.enabled()
    async with running_app(MockFactory()) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
                ).status_code == 200
