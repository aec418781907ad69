"""Rank 0 of a single-host tensor-parallel group, outside the web layer: runs `scenarios` on the TP engine.

    python tp_harness.py SIZE CONFIG_JSON PROMPTS_JSON MAX_TOKENS KINDS OUT_JSON   (KINDS: e.g. batched,singles;
                                                                                  "ahead": the launch-ahead check)

The tests run the same `scenarios` on a one-rank engine in their own process and compare.
"""

from __future__ import annotations

import trillm.kernels  # noqa: F401, I001  (BLAS first)

import json
import sys
from typing import Any

from trillm.engine.config import EngineConfig
from trillm.engine.distributed import LocalRanks, TensorParallelGroup
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.outputs import RequestOutput
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.tp_runner import TensorParallelEngine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)


def _record(out: RequestOutput) -> dict[str, Any]:
    lps = out.logprobs or ()
    return {"tokens": list(out.new_token_ids), "logprobs": [lp.logprob for lp in lps],
            "top": [[list(t) for t in lp.top] for lp in lps]}


KINDS = ("batched", "singles", "staggered")


def scenarios(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
              kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    """Outputs (tokens, logprobs) of the prompts batched, one at a time, and arriving one per step while the
    others decode (so decodes and prefill chunks share steps)."""
    out: dict[str, Any] = {}
    if "batched" in kinds:
        out["batched"] = [_record(o) for o in engine.generate(prompts, params)]
    if "singles" in kinds:
        out["singles"] = [_record(engine.generate([p], params)[0]) for p in prompts]
    if "staggered" in kinds:
        out["staggered"] = _staggered(engine, prompts, params)
    return out


def _staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[dict[str, Any]]:
    parts: dict[str, list[RequestOutput]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"staggered-{i}", p, params)
        parts[f"staggered-{i}"] = []
        for out in engine.step():
            parts[out.request_id].append(out)
    while engine.has_unfinished_requests():
        for out in engine.step():
            parts[out.request_id].append(out)
    return [_record(RequestOutput.concat(parts[f"staggered-{i}"])) for i in range(len(prompts))]


def main(argv: list[str]) -> int:
    size, config_json, prompts_json, max_tokens, out_json = int(argv[0]), argv[1], argv[2], int(argv[3]), argv[5]
    kinds = tuple(argv[4].split(","))
    config = EngineConfig(**json.loads(config_json))
    prompts = json.loads(prompts_json)
    ranks = LocalRanks.start(size)
    try:
        tp = TensorParallelGroup.connect("ring", ranks.doorbell)
        factory = TensorParallelEngine(config, tp)
        engine = factory()
        result = scenarios(engine, prompts, greedy(max_tokens), kinds[:1])
        engine = factory()  # as after an engine failure: a new engine on the same shard, pool and group
        result |= scenarios(engine, prompts, greedy(max_tokens), kinds[1:])
        if "ahead" in kinds:  # a few more steps over the group (seconds each when ranks outnumber cores)
            engine.add_request("ahead", prompts[0], greedy(4))
            engine.step()
            engine.step()
            result["launched_ahead"] = engine.has_step_in_flight
            while engine.has_unfinished_requests():
                engine.step()
        result["plan_overflows"] = factory.channel.num_overflows
        result["worker_exits"] = [str(e) for e in ranks.poll()]
        factory.close()
    finally:
        ranks.stop()
    result["worker_codes"] = [p.returncode for p in ranks.procs]
    with open(out_json, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
