"""The model matrix: every mlx-lm family in tests/model_zoo.py through trillm's paged engine, against mlx-lm's
own generation of the same folder (greedy, fp32, its own caches).

A family expected "identical" must give mlx-lm's greedy tokens and logprobs (chosen and top-3, within tolerance)
for one request, three ragged requests batched, a prompt across several KV blocks and every sliding window
(in one prefill and in chunks), preemption and resume, an abort mid-prefill (its blocks and, for hybrids, its
recurrent-state slot freed), a prefix-cache hit (or, for hybrids, declared without prefix caching, none), and
prompt logprobs. A family
expected "refused" must raise UnsupportedModel (a ModelLoadError) with a one-line message at load, never fail
at request time.
Nothing here is skipped or xfailed: a family the engine gets wrong is a failing test naming what differs.
Engines are shared by the cases of one family (module-scoped fixtures), each case under its own cache_salt
so that no case sees another's prefix-cache entries.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import model_zoo as zoo
from trillm.engine.config import EngineConfig
from trillm.engine.errors import UnsupportedModel
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel, load_model
from trillm.engine.outputs import FinishReason, RequestOutput
from trillm.engine.sampling_params import SamplingParams

# |trillm - mlx-lm| allowed per logprob: LOGPROB_TOL + LOGPROB_RTOL * |mlx-lm's|. The heads are scaled for decisive
# margins, so logprobs reach -150 and fp32 reordering moves them by ~1e-5 relative (mlx-lm against itself, one
# prefill vs 5-token chunks: 6e-4 at -167); a wrong window, head or mask moves them by 1 to 100.
LOGPROB_TOL = 1e-3
LOGPROB_RTOL = 1e-4
TOP = 3  # top logprobs compared per generated token
IDENTICAL = [f for f in zoo.FAMILIES if f.expect == "identical"]
REFUSED = [f for f in zoo.FAMILIES if f.expect == "refused"]
ENGINES: dict[str, dict[str, Any]] = {
    "main": dict(block_size=8, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=128),
    # the long prompt prefilled 16 tokens at a time, so chunk boundaries fall inside and across windows; 16-token
    # blocks (the default), so windows of 5, 8 and 12 sit inside one block
    "chunked": dict(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16),
    # 11 usable blocks of 8 tokens: the four prompts need 21 + 28 + 39 + 73 tokens, so some are preempted (and
    # resume through the prefix cache where their blocks survived); each decode step read back before the next
    "tiny_pool": dict(block_size=8, num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=128,
                      pipeline_decode=False),
}


@dataclass
class Reference:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token
    top: list[list[float]]  # the TOP best logprobs at each step
    margins: list[float]  # top-1 minus top-2 logprob at each step


@dataclass
class Case:
    family: zoo.Family
    path: Path
    refs: dict[str, Reference]
    prompt_logprobs: dict[str, list[float]]  # logprob of prompt token i (i >= 1) under mlx-lm's forward
    loaded: LoadedModel | None = None
    load_error: BaseException | None = None
    engines: dict[str, LLMEngine | BaseException] = field(default_factory=dict)

    def engine(self, kind: str) -> LLMEngine:
        if self.load_error is not None:
            pytest.fail(f"{self.family.name}: trillm refused a family expected identical, at load: "
                        f"{type(self.load_error).__name__}: {self.load_error}")
        if kind not in self.engines:
            try:
                self.engines[kind] = LLMEngine(EngineConfig(**ENGINES[kind]), loaded=self.loaded)
            except Exception as exc:  # noqa: BLE001 - reported by every case that needs this engine
                self.engines[kind] = exc
        eng = self.engines[kind]
        if isinstance(eng, BaseException):
            pytest.fail(f"{self.family.name}: LLMEngine({kind}) failed: {type(eng).__name__}: {eng}")
        return eng


def _reference(model: Any, prompt: list[int]) -> Reference:
    from mlx_lm.generate import generate_step

    ref = Reference([], [], [], [])
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=zoo.NEW_TOKENS,
                                       sampler=lambda x: mx.argmax(x, axis=-1)):
        lp = logprobs.reshape(-1)
        top = sorted(mx.topk(lp, TOP).tolist(), reverse=True)
        ref.tokens.append(int(tok))
        ref.logprobs.append(float(lp[int(tok)]))
        ref.top.append(top)
        ref.margins.append(top[0] - top[1])
    return ref


def _forward_prompt_logprobs(model: Any, prompt: list[int]) -> list[float]:
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    lps = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [float(lps[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def _build_case(family: zoo.Family, tmp: Path) -> Case:
    from mlx_lm import load as mlx_lm_load

    path = zoo.build(family, tmp / family.name)
    model, _ = mlx_lm_load(str(path))  # mlx-lm's own loader, tokenizer included, before any engine patches
    prompts = zoo.matrix_prompts()
    refs = {name: _reference(model, list(p)) for name, p in prompts.items()}
    plp = {name: _forward_prompt_logprobs(model, list(prompts[name])) for name in ("long", "medium")}
    case = Case(family, path, refs, plp)
    try:
        case.loaded = load_model(str(path))
    except Exception as exc:  # noqa: BLE001 - each case reports it
        case.load_error = exc
    return case


@pytest.fixture(scope="module", params=IDENTICAL, ids=[f.name for f in IDENTICAL])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    c = _build_case(request.param, tmp_path_factory.mktemp("zoo"))
    yield c
    c.engines.clear()


def _params(salt: str, **kw: Any) -> SamplingParams:
    base: dict[str, Any] = dict(max_tokens=zoo.NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True,
                                top_logprobs=TOP, cache_salt=salt)
    base.update(kw)
    return SamplingParams(**base)


def _mismatch(family: str, what: str, out: RequestOutput, ref: Reference) -> str | None:
    """Why `out` is not mlx-lm's `ref`, or None."""
    if out.finish_reason is not FinishReason.LENGTH or out.error:
        return f"{family} {what}: finished {out.finish_reason} (error: {out.error})"
    got = list(out.new_token_ids)
    if got != ref.tokens:
        i = next((i for i, (a, b) in enumerate(zip(got, ref.tokens)) if a != b), min(len(got), len(ref.tokens)))
        return (f"{family} {what}: tokens differ from step {i}: trillm {got[i:i + 6]} vs mlx-lm {ref.tokens[i:i + 6]}"
                f" (mlx-lm margin there {ref.margins[i] if i < len(ref.margins) else float('nan'):.3f})")
    assert out.logprobs is not None and len(out.logprobs) == len(got)
    worst = (0.0, -1, "")  # (excess over the tolerance, step, what)
    for i, (lp, want, top) in enumerate(zip(out.logprobs, ref.logprobs, ref.top)):
        if _excess(lp.logprob, want) > worst[0]:
            worst = (_excess(lp.logprob, want), i, f"chosen {lp.logprob:.5f} vs {want:.5f}")
        got_top = sorted((v for _, v in lp.top), reverse=True)
        if len(got_top) != TOP:
            return f"{family} {what}: step {i} has {len(got_top)} top logprobs, asked {TOP}"
        for a, b in zip(got_top, top):
            if _excess(a, b) > worst[0]:
                worst = (_excess(a, b), i, f"top {[round(v, 4) for v in got_top]} vs {[round(v, 4) for v in top]}")
    if worst[0] > 1.0:
        return f"{family} {what}: identical tokens, logprobs off at step {worst[1]}: {worst[2]}"
    return None


def _excess(got: float, want: float) -> float:
    """|got - want| as a multiple of its tolerance (> 1: out of tolerance)."""
    return abs(got - want) / (LOGPROB_TOL + LOGPROB_RTOL * abs(want))


def _check(case: Case, what: str, outs: list[RequestOutput], names: list[str]) -> None:
    problems = [m for out, name in zip(outs, names)
                if (m := _mismatch(case.family.name, f"{what} [{name}]", out, case.refs[name])) is not None]
    assert not problems, "\n".join(problems)


def _prompts(*names: str) -> list[list[int]]:
    return [list(zoo.matrix_prompts()[n]) for n in names]


# ---- identical families --------------------------------------------------------------------------------------
def test_reference_is_decisive(case: Case) -> None:
    # The builder scaled the head for this; asserted on mlx_lm.load's model, the one the references come from.
    worst = min(m for r in case.refs.values() for m in r.margins)
    assert worst >= zoo.MARGIN, f"{case.family.name}: mlx-lm's greedy top-1 margin {worst:.4f} is a coin toss"


def test_window_is_exercised(case: Case) -> None:
    """With its windows (or chunks) made huge, mlx-lm's own prompt logprobs move: the long prompt does cross
    every window."""
    if not case.family.windowed:
        keys = {**case.family.config, **(case.family.text_config or {})}
        assert "sliding_window" not in keys, f"{case.family.name} has a window but is not marked windowed"
        return
    unwindowed = zoo.mlx_lm_model(case.path, {case.family.window_key: 1 << 16})
    moved = _forward_prompt_logprobs(unwindowed, _prompts("long")[0])
    diff = max(abs(a - b) for a, b in zip(moved, case.prompt_logprobs["long"]))
    assert diff > 100 * LOGPROB_TOL, f"{case.family.name}: the window changes prompt logprobs by only {diff:.2g}"


def test_single_request(case: Case) -> None:
    eng = case.engine("main")
    _check(case, "single", eng.generate(_prompts("medium"), _params("single")), ["medium"])


def test_batched_ragged(case: Case) -> None:
    eng = case.engine("main")
    names = ["short", "medium", "ragged"]
    _check(case, "batched", eng.generate(_prompts(*names), _params("batched")), names)


def test_long_prompt_across_blocks_and_windows(case: Case) -> None:
    eng = case.engine("main")
    _check(case, "long prompt (one prefill)", eng.generate(_prompts("long"), _params("long")), ["long"])


def test_chunked_prefill_mixed_with_decodes(case: Case) -> None:
    # Requests arrive one every other step (continuous batching), 16 tokens a step: the long prompt is
    # prefilled in chunks that straddle windows and blocks, in the same steps as the others' decodes.
    eng = case.engine("chunked")
    names = ["short", "long", "ragged", "medium"]
    arrivals = {2 * i: name for i, name in enumerate(names)}
    deltas: dict[str, list[RequestOutput]] = {f"chunked-{n}": [] for n in names}
    step = 0
    while arrivals or eng.has_unfinished_requests():
        if step in arrivals:
            name = arrivals.pop(step)
            eng.add_request(f"chunked-{name}", _prompts(name)[0], _params("chunked"))
        for out in eng.step():
            deltas[out.request_id].append(out)
        step += 1
        assert step < 1000, "the engine stopped making progress"
    _check(case, "staggered, chunked prefill + decodes",
           [RequestOutput.concat(deltas[f"chunked-{n}"]) for n in names], names)


def test_preemption_and_resume(case: Case) -> None:
    eng = case.engine("tiny_pool")
    names = ["long", "ragged", "medium", "short"]
    before = eng.statistics().num_preemptions
    outs = eng.generate(_prompts(*names), _params("preempt"))
    assert eng.statistics().num_preemptions > before, "the tiny pool did not force a preemption"
    _check(case, "preempted", outs, names)
    assert eng.statistics().num_blocks_used == 0


def test_abort_mid_prefill_frees_its_blocks_and_state(case: Case) -> None:
    # The long prompt is aborted after two chunks (16-token steps), batched with another request's prefill and
    # then its decode: the other is untouched, every block (and a hybrid's state slot) comes back, and the long
    # prompt run again afterwards (maybe on the aborted one's slot) is mlx-lm's.
    eng = case.engine("chunked")
    eng.add_request("abort-short", _prompts("short")[0], _params("abort"))
    eng.add_request("abort-long", _prompts("long")[0], _params("abort"))
    deltas: list[RequestOutput] = []
    deltas += eng.step()
    deltas += eng.step()
    seq = next(s for s in eng.scheduler.running if s.request_id == "abort-long")
    assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens, "not mid-prefill"
    eng.abort("abort-long")
    while eng.has_unfinished_requests():
        deltas += eng.step()
    short = RequestOutput.concat([d for d in deltas if d.request_id == "abort-short"])
    assert not any(d.request_id == "abort-long" for d in deltas)
    assert eng.statistics().num_blocks_used == 0
    slots = eng.state_slots
    if slots is not None:
        assert slots.num_free == slots.num_slots, "an aborted sequence kept its state slot"
    again = eng.generate(_prompts("long"), _params("abort"))[0]
    _check(case, "after an abort mid-prefill", [short, again], ["short", "long"])


def test_prefix_cache_hit(case: Case) -> None:
    eng = case.engine("main")
    first = eng.generate(_prompts("long"), _params("prefix"))[0]
    second = eng.generate(_prompts("long"), _params("prefix"))[0]
    branch = eng.generate(_prompts("branch"), _params("prefix"))[0]  # shares the first BRANCH tokens
    _check(case, "prefix cache", [first, second, branch], ["long", "long", "branch"])
    assert first.usage.cached_tokens == 0
    if case.family.prefix_caching:
        assert second.usage.cached_tokens >= 8, f"no prefix-cache hit: {second.usage}"
        assert branch.usage.cached_tokens >= 8, f"no prefix-cache hit on the shared prefix: {branch.usage}"
    else:
        assert second.usage.cached_tokens == branch.usage.cached_tokens == 0, \
            f"prefix caching is declared off, yet {second.usage}, {branch.usage}"


def test_prompt_logprobs(case: Case) -> None:
    eng = case.engine("main")
    names = ["long", "medium"]
    outs = eng.generate(_prompts(*names), _params("plp", max_tokens=1, prompt_logprobs=0, logprobs=False,
                                                  top_logprobs=0))
    problems = []
    for name, out in zip(names, outs):
        got = out.prompt_logprobs
        if out.error or got is None:
            problems.append(f"{name}: no prompt logprobs ({out.finish_reason}, {out.error})")
            continue
        assert got[0] is None and len(got) == len(case.prompt_logprobs[name]) + 1
        if any(g is None for g in got[1:]):
            problems.append(f"{name}: a prompt position has no logprob")
            continue
        pairs = [(g.logprob, w) for g, w in zip(got[1:], case.prompt_logprobs[name]) if g is not None]
        excess = [_excess(g, w) for g, w in pairs]
        i = max(range(len(excess)), key=excess.__getitem__)
        if excess[i] > 1.0:
            got_lp, want_lp = pairs[i]
            problems.append(f"{name}: prompt logprob of position {i + 1} is {got_lp:.5f}, mlx-lm {want_lp:.5f}")
    assert not problems, f"{case.family.name} prompt logprobs vs mlx-lm's forward: " + "; ".join(problems)


# ---- refused families ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", REFUSED, ids=[f.name for f in REFUSED])
def test_refused_at_load_in_one_line(family: zoo.Family, tmp_path: Path) -> None:
    path = zoo.build(family, tmp_path / family.name, check_margin=False)
    model = zoo.mlx_lm_model(path)  # mlx-lm itself runs it: the refusal is the engine's, not a broken folder
    mx.eval(model(mx.array(_prompts("short"))))
    # Refused on purpose (the architecture check), not by accident (a config key the loader happens to miss).
    with pytest.raises(UnsupportedModel) as info:
        LLMEngine(EngineConfig(block_size=8, num_kv_blocks=64), loaded=load_model(str(path)))
    message = str(info.value).strip()
    assert message and "\n" not in message, f"not one line: {message!r}"
    assert path.name in message, f"the refusal does not name the model: {message!r}"


# ---- the docs table ------------------------------------------------------------------------------------------
def test_supported_models_doc_is_generated() -> None:
    want = zoo.supported_models_markdown()
    have = zoo.DOCS.read_text() if zoo.DOCS.is_file() else ""
    assert have == want, f"{zoo.DOCS} is out of date; regenerate it with `python tests/model_zoo.py --write-docs`"
