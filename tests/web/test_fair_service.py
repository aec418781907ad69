"""Fair admission through the service: one client request's fan-out (prompts x n) is one group; alone it may
use the whole batch, but another request's first token does not wait behind it, and one request cannot take
more than its share of the queue. The mock engine inline on trio's MockClock: steps are counted, not timed."""

from __future__ import annotations

from collections import Counter

import pytest
import trio
import trio.testing

from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.mock import LinearCostModel, make_mock_engine
from trillm.engine.sampling_params import SamplingParams
from trillm.web.service.engine_service import EngineService

from conftest import SPEC

STEP_S = 0.002
LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(num_kv_blocks=2048, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=256)


async def test_a_short_request_takes_a_row_from_a_fan_out_holding_the_whole_batch(
        autojump_clock: trio.testing.MockClock) -> None:
    engines: list[LLMEngine] = []

    def factory() -> LLMEngine:
        engines.append(make_mock_engine(CONFIG, spec=SPEC, perf=LinearCostModel(STEP_S, 0, 0, STEP_S, 0, 0)))
        return engines[-1]

    async with trio.open_nursery() as nursery:
        service = await nursery.start(EngineService(factory, inline=True).run)
        with pytest.raises(InvalidRequest, match=r"65 generations .*at most 64 .*--max-waiting 256"):
            service.submit_prompts([[5, 6]] * 13, [LONG] * 5)
        huge = service.submit_prompts([[5, 6, i] for i in range(32)], [LONG, LONG])  # 64: at the bound
        with trio.fail_after(10):
            while (s := service.statistics().engine) is None or s.num_running < 8:
                await trio.sleep(STEP_S)
        scheduler = engines[-1].scheduler
        assert {q.group for q in scheduler.running} == {huge.request_ids[0]}  # alone: every row
        tokens: Counter[str] = Counter()
        for k in range(3):
            steps_before = service.statistics().num_steps
            short = service.submit([9, 9, k], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            with trio.fail_after(10):
                first = await short.receive()
            waited = service.statistics().num_steps - steps_before
            # The step in progress, then its own: FCFS (or a fan-out keeping its rows) ~100 steps.
            assert first.new_token_ids and waited <= 2, waited
            assert sum(q.group == huge.request_ids[0] for q in scheduler.running) == 7  # its fair share
            short.close()
            await trio.sleep(5 * STEP_S)
        assert scheduler.num_preemptions == 3  # one row per newcomer, handed back when it is done
        # The fan-out progressed all along and completes, each generation with all its tokens.
        with huge, trio.fail_after(60):
            while True:
                try:
                    out = await huge.receive()
                except trio.EndOfChannel:
                    break
                tokens[out.request_id] += len(out.new_token_ids)
        assert tokens == dict.fromkeys(huge.request_ids, LONG.max_tokens)
        nursery.cancel_scope.cancel()
