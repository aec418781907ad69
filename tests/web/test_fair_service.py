"""Fair admission through the service: one client request's fan-out (prompts x n) is one group, so another
request's first token does not wait behind it, and one request cannot take more than its share of the queue."""

from __future__ import annotations

import pytest
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest
from trillm.engine.sampling_params import SamplingParams

from conftest import MockFactory, running_service

LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)


async def test_a_short_request_is_not_queued_behind_a_fan_out() -> None:
    cfg = EngineConfig(num_kv_blocks=2048, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=256)
    async with running_service(MockFactory(config=cfg, step_delay=0.002)) as service:
        with pytest.raises(InvalidRequest, match=r"65 generations .*at most 64 .*--max-waiting 256"):
            service.submit_prompts([[5, 6]] * 13, [LONG] * 5)
        huge = service.submit_prompts([[5, 6, i] for i in range(32)], [LONG, LONG])  # 64: at the bound
        with trio.fail_after(10):
            while (s := service.statistics().engine) is None or s.num_running < 7:
                await trio.sleep(0.005)
        # The fan-out holds all but an eighth of the running batch: the rest is kept for others.
        assert service.statistics().engine.num_running == 7  # type: ignore[union-attr]
        steps_before = service.statistics().num_steps
        short = service.submit([9, 9, 9], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        with trio.fail_after(10):
            first = await short.receive()
        waited = service.statistics().num_steps - steps_before
        assert first.new_token_ids and waited <= 4, waited  # FCFS: ~300 steps, until a long one finished
        short.close()
        huge.close()
