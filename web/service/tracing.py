"""OpenTelemetry traces of each generation request (`trillm serve --otlp-traces-endpoint URL`).

One span per request, `llm.request` (kind SERVER, the child of the incoming W3C `traceparent` when there is
one), with a child span per phase, laid out on the request's own timeline:
- `queue`: from the submission until the engine scheduled the request's first prefill chunk;
- `prefill`: from then until its first token;
- `decode`: from the first token to the last;
- `stream`: from the first output the client read until the response was done (the bytes going out).
A request with n > 1 generations (or several prompts) gets one span per phase over all of them: the first
start, the last end. Attributes follow OpenTelemetry's gen_ai conventions where they have a name
(gen_ai.request.model, gen_ai.usage.input_tokens, ...), and the API key's name (never the key).

The SDK is an optional extra (`pip install trillm[otel]`); without an endpoint nothing here is imported and
every hook is a no-op. All hooks run on the trio thread.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from trillm.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

_tracer: Tracer | None = None
_provider: TracerProvider | None = None


class TracingUnavailable(ValueError):
    """--otlp-traces-endpoint was given but the OpenTelemetry SDK is not installed."""


def configure(endpoint: str, *, service_name: str = "trillm") -> None:
    """Export every request's spans to the OTLP/HTTP collector at `endpoint` (e.g. http://host:4318/v1/traces)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable("--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'trillm[otel]'"
                                 ) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    # Batched on the SDK's own thread: exporting never blocks the event loop.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    use_provider(provider)


def use_provider(provider: TracerProvider | None) -> None:
    """Trace with `provider` (tests pass one with an in-memory exporter); None turns tracing off."""
    global _tracer, _provider
    _provider = provider
    _tracer = None if provider is None else provider.get_tracer("trillm.web")


def shutdown() -> None:
    """Flush what is batched (at server shutdown)."""
    if _provider is not None:
        _provider.shutdown()


def enabled() -> bool:
    return _tracer is not None


class RequestTrace:
    """The timeline of one request, turned into its spans when the request is done (`end`)."""

    def __init__(self, tracer: Tracer, headers: Any, attributes: dict[str, Any]) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # W3C traceparent / tracestate (the headers' own get: case-insensitive)
        parent = TraceContextTextMapPropagator().extract(headers if headers is not None else {})
        self._tracer = tracer
        self._span = tracer.start_span("llm.request", context=parent, kind=SpanKind.SERVER, attributes=attributes)
        self.submitted: int | None = None
        self.prefill_start: int | None = None
        self.first_token: int | None = None
        self.last_token: int | None = None
        self.first_read: int | None = None
        self._finish_reasons: dict[str, str] = {}
        self._input_tokens: dict[str, int] = {}
        self._output_tokens: dict[str, int] = {}
        self._ended = False

    def on_submitted(self, request_ids: tuple[str, ...]) -> None:
        self.submitted = time.time_ns()
        self._span.set_attribute("trillm.request_ids", list(request_ids))

    def on_prefill(self) -> None:
        if self.prefill_start is None:
            self.prefill_start = time.time_ns()

    def on_output(self, output: RequestOutput) -> None:
        now = time.time_ns()
        if output.new_token_ids:
            self.first_token = self.first_token or now
            self.last_token = now
        self._input_tokens[output.request_id] = output.usage.prompt_tokens
        self._output_tokens[output.request_id] = output.usage.completion_tokens
        if output.finish_reason is not None:
            self._finish_reasons[output.request_id] = output.finish_reason.value

    def on_read(self) -> None:
        if self.first_read is None:
            self.first_read = time.time_ns()

    def fail(self, exc: BaseException) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.record_exception(exc)
        self._span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))

    def end(self) -> None:
        """Write the phase spans and end the request's span (once; later calls do nothing)."""
        if self._ended:
            return
        self._ended = True
        from opentelemetry.trace import set_span_in_context

        end = time.time_ns()
        ctx = set_span_in_context(self._span)
        queue_end = self.prefill_start or self.first_token
        phases = (("queue", self.submitted, queue_end), ("prefill", self.prefill_start, self.first_token),
                  ("decode", self.first_token, self.last_token), ("stream", self.first_read, end))
        for name, start, stop in phases:
            if start is not None and stop is not None:
                self._tracer.start_span(name, context=ctx, start_time=start).end(end_time=max(start, stop))
        if self._finish_reasons:
            self._span.set_attribute("gen_ai.response.finish_reasons", sorted(set(self._finish_reasons.values())))
        self._span.set_attribute("gen_ai.usage.input_tokens", sum(self._input_tokens.values()))
        self._span.set_attribute("gen_ai.usage.output_tokens", sum(self._output_tokens.values()))
        self._span.end(end_time=end)


def start_request(headers: Any, **attributes: Any) -> RequestTrace | None:
    """A new request's trace (the child of its `traceparent`), or None while tracing is off."""
    if _tracer is None:
        return None
    return RequestTrace(_tracer, headers, {k: v for k, v in attributes.items() if v is not None})
