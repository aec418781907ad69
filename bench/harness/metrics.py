"""Per-request records and the serving metrics of vLLM's benchmark_serving, computed from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did, timed on the client. Times are seconds; chunk_times are from the request's start.

    chunk_times holds the arrival time of every streamed chunk that carried generated text; the first is the
    TTFT and the gaps between them are the ITLs.
    """

    request_id: str
    start: float  # seconds from the run's start
    latency: float  # end to end
    chunk_times: tuple[float, ...] = ()
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None  # from the server's usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    num_chars: int = 0
    error_kind: str | None = None  # None when it succeeded
    error: str | None = None
    turn: int = 0
    text: str | None = None  # the generated text, when the run kept it (GenerationOptions.keep_text)

    @property
    def success(self) -> bool:
        return self.error_kind is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def output_tokens(self) -> int:
        """The server's completion_tokens, else the number of text chunks (one token each, usually)."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1); None for one-token outputs."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, output_tokens=self.output_tokens)
        return d


@dataclass(frozen=True, slots=True)
class Stat:
    """A latency distribution in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stat:
        if not seconds:
            return cls(0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(np.percentile(ms, p)) for p in PERCENTILES)  # linear interpolation, as vLLM
        return cls(float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objective for goodput, in milliseconds; None leaves that metric unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, rec: RequestRecord) -> bool:
        if not rec.success:
            return False
        if self.ttft_ms is not None and (rec.ttft is None or rec.ttft * 1000 > self.ttft_ms):
            return False
        return self.tpot_ms is None or (rec.tpot or 0.0) * 1000 <= self.tpot_ms


@dataclass(frozen=True, slots=True)
class Summary:
    """The aggregate of one run (one server, one workload, one arrival setting)."""

    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    usage_reported: int  # completed requests whose server reported usage
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests / s meeting the SLO; None without one
    ttft: Stat
    tpot: Stat
    itl: Stat
    e2e: Stat
    slo: SLO | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> Summary:
    """Aggregate records the way vLLM's benchmark_serving does; failed requests count only as errors."""
    ok = [r for r in records if r.success]
    errors: dict[str, int] = {}
    for r in records:
        if r.error_kind is not None:
            errors[r.error_kind] = errors.get(r.error_kind, 0) + 1
    inp = sum(r.prompt_tokens or 0 for r in ok)
    out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        input_tokens=inp,
        output_tokens=out,
        cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        usage_reported=sum(r.completion_tokens is not None for r in ok),
        request_throughput=len(ok) / dur,
        output_throughput=out / dur,
        total_token_throughput=(inp + out) / dur,
        goodput=None if slo is None else sum(slo.met_by(r) for r in ok) / dur,
        ttft=Stat.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Stat.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Stat.of([g for r in ok for g in r.itl]),
        e2e=Stat.of([r.latency for r in ok]),
        slo=slo,
    )
