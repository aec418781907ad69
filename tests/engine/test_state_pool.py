"""The recurrent-state pool of hybrid models (engine/state_pool.py): slots are conserved through any sequence of
admissions and frees (with the block manager, which takes and frees them with a sequence's blocks); a forward
reads zeros for rows at position 0 and each other row's own slot, and writes back only its rows' slots, only
when it completes; the pool comes out of the KV memory budget; and a model whose recurrent layers do not mask
padding never sees a padded row (with padding it would be wrong, which is why the guard exists)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests import model_zoo
from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.errors import ModelLoadError
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import load_model
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.sequence import Sequence
from trillm.engine.state_pool import LayerState, StateEntry, StatePool, StateSlots, state_rows

PARAMS = SamplingParams(max_tokens=4)


def _seq(i: int, n: int = 5) -> Sequence:
    return Sequence(f"s{i}", list(range(1, n + 1)), PARAMS)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60))
def test_slots_are_conserved(num_slots: int, ops: list[tuple[bool, int]]) -> None:
    slots = StateSlots(num_slots)
    seqs = [_seq(i) for i in range(10)]
    live: list[Sequence] = []
    for take, i in ops:
        seq = seqs[i]
        if take and seq not in live and slots.num_free:
            slots.take(seq)
            live.append(seq)
        elif not take:
            slots.release(seq)  # releasing a sequence that holds none is a no-op
            if seq in live:
                live.remove(seq)
        slots.check_invariants(live)
        assert slots.num_free == num_slots - len(live)
    for seq in live:
        slots.release(seq)
    assert slots.num_free == num_slots


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 40)), max_size=40))
def test_block_manager_takes_and_frees_a_slot_with_the_blocks(ops: list[tuple[bool, int, int]]) -> None:
    slots = StateSlots(3)
    bm = BlockManager(24, 8, enable_prefix_caching=False, state_slots=slots)
    seqs: dict[int, Sequence] = {}
    for admit, i, n in ops:
        if admit and i not in seqs:
            seq = _seq(i, n)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                seqs[i] = seq
            else:  # refused only for want of blocks or of a slot
                assert slots.num_free == 0 or bm.blocks_needed(n) > bm.num_free_blocks
        elif not admit and i in seqs:
            bm.deallocate(seqs.pop(i))  # finish, abort and preemption all come here
        bm.check_invariants(list(seqs.values()))
    for seq in seqs.values():
        bm.deallocate(seq)
    assert slots.num_free == 3 and bm.num_used_blocks == 0


def test_a_forward_reads_its_rows_slots_and_writes_back_only_those() -> None:
    layers = (LayerState((StateEntry((3, 2), mx.float32), StateEntry((2,), mx.float32))),)
    pool = StatePool(layers, StateSlots(4))
    conv = mx.arange(4 * 6, dtype=mx.float32).reshape(4, 3, 2) + 1
    pool.set_states(0, 0, conv)
    cache = pool.caches()[0]
    # row 0: a new sequence (position 0) on slot 2; row 1: slot 0, already 5 tokens in; ragged (3 and 1 tokens)
    pool.begin(state_rows([2, 0], [0, 5], [3, 1]))
    got = cache[0]
    assert mx.array_equal(got[0], mx.zeros((3, 2))).item() and mx.array_equal(got[1], conv[0]).item()
    mask = cache.make_mask(3)
    assert mask is not None and mask.tolist() == [[True, True, True], [True, False, False]]
    cache[0] = mx.full((2, 3, 2), 7.0)
    cache[1] = mx.array([[1.0, 2.0], [3.0, 4.0]])
    pool.commit()
    pool.end()
    after = pool.arrays_by_layer[0][0]
    assert (after[2] == 7).all().item() and (after[0] == 7).all().item()
    assert mx.array_equal(after[1], conv[1]).item() and mx.array_equal(after[3], conv[3]).item()
    assert pool.arrays_by_layer[0][1].tolist() == [[3.0, 4.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]
    # a forward that raised (no commit) leaves every state as it was; rows of one length have no mask
    pool.begin(state_rows([0, 1], [8, 9], [1, 1]))
    assert cache.make_mask(1) is None
    cache[0] = mx.zeros((2, 3, 2))
    pool.end()
    assert mx.array_equal(pool.arrays_by_layer[0][0], after).item()


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_zoo.build("qwen3_next", tmp_path_factory.mktemp("qn") / "qwen3_next", check_margin=False)


def test_the_state_pool_comes_out_of_the_memory_budget(qwen3_next: Path) -> None:
    lm = load_model(str(qwen3_next))
    probe = LLMEngine(EngineConfig(block_size=8, num_kv_blocks=16, max_num_seqs=4, verify_model=False), loaded=lm)
    layout = probe.kv_layout
    assert layout is not None and layout.states and probe.state_slots is not None
    per_seq, per_block = layout.state_bytes_per_sequence, layout.bytes_per_block(8, lm.dtype)
    # 4 slots and 3 prefix-cache checkpoints of the recurrent state come out of the budget before the blocks
    memory = (4 + 3) * per_seq + 100 * per_block + per_block // 2
    eng = LLMEngine(EngineConfig(block_size=8, max_num_seqs=4, kv_cache_memory_gb=memory / 1e9, max_state_checkpoints=3,
                                 verify_model=False), loaded=lm)
    assert eng.block_manager.num_blocks == 100 and eng.block_manager.enable_prefix_caching
    states = eng.runner.pool.states  # type: ignore[attr-defined]
    assert states is not None and states.nbytes == 4 * per_seq
    with pytest.raises(ModelLoadError, match="recurrent state"):
        LLMEngine(EngineConfig(block_size=8, max_num_seqs=4, kv_cache_memory_gb=3 * per_seq / 1e9, verify_model=False),
                  loaded=lm)


def _greedy_top(model: object, prompt: list[int], n: int) -> list[list[float]]:
    """mlx-lm's own greedy generation: the 3 best logprobs at each step."""
    from mlx_lm.generate import generate_step

    out = []
    for _, logprobs in generate_step(mx.array(prompt), model, max_tokens=n,  # type: ignore[arg-type]
                                     sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(sorted(mx.topk(logprobs.reshape(-1), 3).tolist(), reverse=True))
    return out


def test_nemotron_h_prefills_ragged_rows_through_the_seams_lengths(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Nemotron-H's Mamba-2 mixer passes the mask but not the rows' lengths to its scan: alone, padding after a
    # short row's last token drops that row's prompt from its state. The engine's ssm_update seam adds the
    # lengths the mask says, so ragged rows share one forward and match mlx-lm; with mlx-lm's own ssm_update
    # in the seam's place, the padded row's first decode is off.
    path = model_zoo.build("nemotron_h", tmp_path / "nemotron_h")
    lm = load_model(str(path))
    prompts = [list(model_zoo.matrix_prompts()[n]) for n in ("ragged", "medium")]  # 23 and 12: one forward if ragged
    refs = [_greedy_top(lm.model, p, 3) for p in prompts]
    config = EngineConfig(block_size=8, num_kv_blocks=64, max_num_seqs=4, verify_model=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)

    def worst(engine: LLMEngine) -> float:
        outs = engine.generate(prompts, params)
        return max(abs(got - want) for out, ref in zip(outs, refs) for lp, top in zip(out.logprobs or (), ref)
                   for got, want in zip(sorted((v for _, v in lp.top), reverse=True), top))

    engine = LLMEngine(config, loaded=lm)
    assert engine.runner.max_waste == 1.5  # type: ignore[attr-defined]
    assert worst(engine) < 1e-3
    module = sys.modules[type(lm.model).__module__]
    monkeypatch.setattr(module, "ssm_update", module.ssm_update.__trillm_original__)
    assert worst(engine) > 0.1


def test_a_commit_touches_only_its_rows_slots() -> None:
    # A step's state update leaves every slot outside its batch the very array it was (no copy of the pool, no
    # rewrite of other rows), and the next forward over the same rows reads back exactly what was written.
    layers = (LayerState((StateEntry((3, 2), mx.float32),)),)
    slots = StateSlots(6)
    pool = StatePool(layers, slots)
    init = mx.arange(6 * 6, dtype=mx.float32).reshape(6, 3, 2)
    pool.set_states(0, 0, init)
    before = list(pool.by_slot[0][0])
    cache = pool.caches()[0]
    for step in range(3):
        pool.begin(state_rows([4, 1], [5 + step, 7 + step], [1, 1]))
        new = cache[0] + 1.0
        cache[0] = new
        pool.commit()
        pool.end()
    after = pool.by_slot[0][0]
    assert all(after[s] is before[s] for s in (0, 2, 3, 5))
    stacked = pool.arrays_by_layer[0][0]
    expect = mx.concatenate([init[:1], init[1:2] + 3, init[2:4], init[4:5] + 3, init[5:]], axis=0)
    assert mx.array_equal(stacked, expect).item()
    # a freed slot drops its state: a sequence given it next reads zeros even without the fresh flag
    seq = _seq(0)
    assert slots.take(seq) == 0
    slots.release(seq)
    assert mx.array_equal(pool.by_slot[0][0][0], mx.zeros((1, 3, 2))).item()


def test_a_prefill_commit_keeps_only_the_state_not_the_layers_input() -> None:
    # mlx-lm's Mamba-2 leaves its conv window as a slice of the layer's whole padded input; kept as is, each slot
    # would hold that input (here 8 MB a layer for 48 KB of state) alive until the slot's next forward.
    B, L, K, C = 4, 512, 3, 1024
    layers = tuple(LayerState((StateEntry((K, C), mx.float32),)) for _ in range(2))
    pool = StatePool(layers, StateSlots(6))
    mx.eval(pool.arrays())
    gc.collect()
    base = mx.get_active_memory()
    pool.begin(state_rows([3, 0, 5, 1], [0] * B, [L] * B))
    expect = []
    for cache in pool.caches():
        padded = mx.random.normal((B, L + K, C))
        cache[0] = padded[:, -K:, :]
        expect.append(padded[:, -K:, :])
    mx.eval(expect)
    expect = [mx.array(np.array(e)) for e in expect]
    del padded
    pool.commit()
    mx.eval(pool.arrays())
    pool.end()
    gc.collect()
    held = mx.get_active_memory() - base - sum(e.nbytes for e in expect)
    state = len(layers) * B * K * C * 4
    assert held < 4 * state, (held, state)
    for j, e in enumerate(expect):
        assert mx.array_equal(pool.arrays_by_layer[j][0][mx.array([3, 0, 5, 1])], e).item()
