"""One generation's output stream: a memory channel fed with `send_nowait`, coalescing when the client lags.

Concurrency invariant: every method here runs on the trio thread. The engine thread never touches a
`GenerationHandle`; the service hands it whole `RequestOutput`s during its one hop per engine step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from trillm.engine.errors import EngineError
from trillm.engine.outputs import FinishReason, RequestOutput, Usage

if TYPE_CHECKING:
    from trillm.web.service.metrics import ModelMetrics
    from trillm.web.service.tracing import RequestTrace


def buffered_size(output: RequestOutput) -> int:
    """What one delta costs to hold, roughly in bytes: its text, 8 per token id, 16 per logprob number."""
    size = len(output.new_text.encode()) + 8 * len(output.new_token_ids)
    for lp in output.logprobs or ():
        size += 16 + 16 * len(lp.top)
    for plp in output.prompt_logprobs or ():
        size += 16 if plp is None else 16 + 16 * len(plp.top)
    return size


class GenerationFailed(Exception):
    """The generation ended with an error: the engine failed, or the client fell too far behind."""


class GenerationHandle:
    """The client side of one submission: n >= 1 engine requests per prompt, of one prompt or a batch.

    Deltas arrive through `feed` (one engine step at a time) and leave through `receive`. The channel has a
    small fixed buffer; when it is full a request's newer deltas are merged into one pending delta, so a slow
    client never blocks the engine and memory grows only with what is unread. Past `max_buffered_bytes` of
    unread output (text, token ids and logprobs, see `buffered_size`) the handle fails with a clear error and its
    requests are aborted; a single delta over that size is delivered when nothing else is unread. A failure (the engine refused a request
    while adding it, the engine failed, the client lagged) is raised by the next `receive`.

    `admitted` waits for the engine's verdict on adding the requests (the memory check runs on the engine
    thread), so a route can turn a refusal into an HTTP error before it sends a stream's headers.

    `deadline` (trio time): once it passes, the next `receive` ends every unfinished request with
    FinishReason.TIMEOUT (after what was already buffered) and aborts it, which frees its KV blocks.
    """

    def __init__(
        self,
        request_ids: tuple[str, ...],
        *,
        abort: Callable[[str], None],
        channel_size: int,
        max_buffered_bytes: int,
        metrics: ModelMetrics | None = None,
        deadline: float | None = None,
        prompt_lengths: tuple[int, ...] | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        self.request_ids = request_ids
        self.trace = trace  # OpenTelemetry (web/service/tracing.py): fed each output, ended by close
        self.deadline = deadline
        # Each request's latest usage, for the final delta a timeout writes (before any delta: its prompt length).
        self._usage = {rid: Usage(n, 0, 0) for rid, n in zip(request_ids, prompt_lengths or ())}
        self._abort = abort
        self._max_buffered_bytes = max_buffered_bytes
        self._metrics = metrics
        self._send, self._recv = trio.open_memory_channel[RequestOutput](channel_size)
        self._pending: dict[str, RequestOutput] = {}
        self._buffered_bytes = 0
        self._exempt_bytes = 0  # an oversized delta admitted into an empty buffer (see feed)
        self._unfinished = set(request_ids)
        self._unadded = set(request_ids)  # not yet taken by the engine
        self._verdict = trio.Event()  # all taken, or the handle ended (a refusal fails it)
        self._failure: BaseException | None = None
        self._closed = False
        self._t_submit = time.perf_counter()
        self._t_last: dict[str, float] = {}
        self._t_prefill: dict[str, float] = {}  # when each request's first prefill chunk was scheduled
        self._t_first: dict[str, float] = {}

    # ---- engine side (called by EngineService on the trio thread) ----

    def feed(self, output: RequestOutput) -> None:
        rid = output.request_id
        if self._closed or rid not in self._unfinished:
            return
        self._observe(output)
        self._usage[rid] = output.usage
        if self.trace is not None:
            self.trace.on_output(output)
        if output.finish_reason is FinishReason.ERROR:
            self.fail(GenerationFailed(output.error or "the engine failed while serving this request"))
            return
        if output.finished:
            self._unfinished.discard(rid)
        size = buffered_size(output)
        if self._buffered_bytes == 0 and size > self._max_buffered_bytes:
            # One delta larger than the whole budget (a long prompt's prompt_logprobs) arriving when nothing else
            # is unread is one step's output, not a client falling behind: it does not count against the budget
            # until the client has read everything again. What comes on top of it does.
            self._exempt_bytes = size
        self._buffered_bytes += size
        if rid in self._pending:
            self._pending[rid] = RequestOutput.concat([self._pending[rid], output])
        else:
            try:
                self._send.send_nowait(output)
            except trio.WouldBlock:
                self._pending[rid] = output
        if self._buffered_bytes > self._max_buffered_bytes + self._exempt_bytes:
            self.fail(GenerationFailed(
                f"the client read too slowly: more than {self._max_buffered_bytes} bytes of output were "
                "buffered, so the request was aborted"))
            return
        if not self._unfinished:
            self._send.close()

    def on_added(self, request_id: str) -> None:
        """The engine took one of the requests (it may still fail later: that is an error in the stream)."""
        self._unadded.discard(request_id)
        if not self._unadded:
            self._verdict.set()

    def on_rejected(self, request_id: str, error: BaseException) -> None:
        """The engine refused one of the requests while adding it: the whole submission fails with `error`."""
        self._unfinished.discard(request_id)
        self.fail(error)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (the next `receive` raises it) and abort what is still running."""
        if self._failure is None and not self._closed:
            self._failure = error
            if self.trace is not None:
                self.trace.fail(error)
            if self._metrics is not None:
                self._metrics.on_outcome("rejected" if isinstance(error, EngineError) else "error")
        self.close()

    def on_prefill(self, request_id: str) -> None:
        """The engine scheduled a prefill chunk of `request_id` (its first: the request left the queue)."""
        self._t_prefill.setdefault(request_id, time.perf_counter())
        if self.trace is not None:
            self.trace.on_prefill()

    # ---- client side ----

    async def admitted(self) -> None:
        """Wait until the engine took every request (or the deadline passed, or the handle ended); raise a
        refusal that ended the handle before then (an EngineError: Overloaded by the memory check, a drain's
        EngineUnavailable). Other failures (the engine failed in the step that took the request) are left to
        `receive`, after a stream's start."""
        with trio.move_on_at(math.inf if self.deadline is None else self.deadline):
            await self._verdict.wait()
        if self._unadded and isinstance(self._failure, EngineError):
            raise self._failure

    def _time_out(self) -> None:
        """The deadline passed: end each unfinished request with TIMEOUT, behind its unread deltas, and abort it."""
        timed_out = [rid for rid in self.request_ids if rid in self._unfinished]
        if not timed_out or self._closed or self._failure is not None:
            return
        for rid in timed_out:
            final = RequestOutput(rid, (), "", FinishReason.TIMEOUT, self._usage.get(rid, Usage(0, 0, 0)))
            pending = self._pending.get(rid)
            self._pending[rid] = final if pending is None else RequestOutput.concat([pending, final])
            self._unfinished.discard(rid)
            self._abort(rid)
        if self._metrics is not None:
            self._metrics.on_outcome("timeout")
        self._send.close()  # the pending finals follow what the channel holds

    def expire(self) -> bool:
        """Time out now if the deadline has passed (the service calls it each step, so a deadline frees the
        blocks even while the client is not reading); whether the handle is done with."""
        if self._past_deadline():
            self._time_out()
        return self._closed or not self._unfinished

    def _past_deadline(self) -> bool:
        return self.deadline is not None and bool(self._unfinished) and trio.current_time() >= self.deadline

    def receive_nowait(self) -> RequestOutput:
        """The next delta if one is ready: `trio.WouldBlock` if none, `trio.EndOfChannel` after the last."""
        self._raise_if_failed()
        if self._past_deadline():
            self._time_out()
        try:
            output = self._recv.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            if not self._pending:
                raise
            output = self._pending.pop(next(iter(self._pending)))
        self._taken(output)
        return output

    async def receive(self) -> RequestOutput:
        """The next delta of any of the n requests; `trio.EndOfChannel` after the last one."""
        try:
            return self.receive_nowait()
        except trio.WouldBlock:
            pass
        try:
            with trio.move_on_at(math.inf if self.deadline is None else self.deadline):
                output = await self._recv.receive()
                self._raise_if_failed()  # it may have failed while we waited
                self._taken(output)
                return output
        except trio.EndOfChannel:
            self._raise_if_failed()
            raise
        return self.receive_nowait()  # the deadline passed: the timeout's finals

    def _taken(self, output: RequestOutput) -> None:
        if self.trace is not None:
            self.trace.on_read()
        self._buffered_bytes -= buffered_size(output)
        if self._buffered_bytes <= 0:
            self._exempt_bytes = 0

    async def receive_batch(self, max_items: int = 256) -> list[RequestOutput]:
        """Wait for at least one delta, then take every one already there (one write for all of them)."""
        batch = [await self.receive()]
        while len(batch) < max_items:
            try:
                batch.append(self.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        return batch

    async def drain(self, feed: Callable[[RequestOutput], object]) -> None:
        """Feed every delta to `feed` (collecting a non-streamed answer), then close."""
        with self:
            while True:
                try:
                    output = await self.receive()
                except trio.EndOfChannel:
                    return
                feed(output)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Abort every unfinished request (synchronous, so it is safe in a cancelled `finally`)."""
        if self._closed:
            return
        self._closed = True
        self._verdict.set()
        if self.trace is not None:
            self.trace.end()
        if self._unfinished and self._failure is None and self._metrics is not None:
            self._metrics.on_outcome("abort")
        for rid in self.request_ids:
            if rid in self._unfinished:
                self._abort(rid)
        self._unfinished.clear()
        self._pending.clear()
        self._send.close()

    def __enter__(self) -> GenerationHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _observe(self, output: RequestOutput) -> None:
        if self._metrics is None:
            return
        now = time.perf_counter()
        n = len(output.new_token_ids)
        last = self._t_last.get(output.request_id)
        self._metrics.on_delta(output, first=last is None and (n > 0 or output.finished))
        if n:
            if last is None:
                self._metrics.ttft.observe(now - self._t_submit)
                self._t_first[output.request_id] = now
            else:
                self._metrics.inter_token.observe((now - last) / n)
            self._t_last[output.request_id] = now
        if output.finished and output.finish_reason is not FinishReason.ERROR:
            self._metrics.e2e.observe(now - self._t_submit)
            self._metrics.on_finished(output)
            rid = output.request_id
            started = self._t_prefill.get(rid, self._t_first.get(rid, now))
            first = self._t_first.get(rid, now)
            self._metrics.on_phases(queue=started - self._t_submit, prefill=first - started,
                                    decode=self._t_last.get(rid, now) - first)
