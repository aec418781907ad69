"""Scoring over HTTP on the real engine (tiny model): echo, prompt batches and prompt_logprobs through the
official openai SDK and lm-evaluation-harness itself, each against mlx-lm's own forward on the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
import trio
import trio_websocket

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel

from conftest import parse_sse, running_server

ATOL = 1e-4


class TinyEngine:
    def __init__(self, path: Path, **config: Any) -> None:
        self.config = EngineConfig(model=str(path), **{"num_kv_blocks": 512, "max_num_batched_tokens": 64, **config})

    def __call__(self) -> LLMEngine:
        return LLMEngine(self.config)


def logprobs_truth(model: LoadedModel, ids: list[int]) -> np.ndarray:
    """log-softmax (in float64) of mlx-lm's logits over the whole sequence, one forward: row p scores token p + 1."""
    logits = np.array(model.model(mx.array(ids)[None])[0].astype(mx.float32)).astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))


def greedy_truth(model: LoadedModel, ids: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids), model.model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]


def sdk_scoring(base_url: str, prompts: list[list[int]], texts: list[str]) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=60)
    return {
        "ids": client.completions.create(model="tiny-llama", prompt=prompts, echo=True, logprobs=2, max_tokens=1,
                                         temperature=0),
        "texts": client.completions.create(model="tiny-llama", prompt=texts, echo=True, logprobs=1, max_tokens=0),
        "n2": client.completions.create(model="tiny-llama", prompt=texts, echo=True, max_tokens=3, n=2, temperature=0,
                                        extra_body={"ignore_eos": True}),
    }


async def test_openai_sdk_echo_logprobs_and_prompt_batches(tiny_model_path: Path, tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "hello", "def add(a, b):\n    return a + b\n"]
    prompts = [tok.encode(t) for t in texts]
    async with running_server(TinyEngine(tiny_model_path)) as serving:
        out = await trio.to_thread.run_sync(sdk_scoring, serving.url, prompts, texts)

    ids = out["ids"]
    assert [c.index for c in ids.choices] == [0, 1, 2]
    assert ids.usage.prompt_tokens == sum(map(len, prompts)) and ids.usage.completion_tokens == 3
    for ids_, choice in zip(prompts, ids.choices):
        ref = logprobs_truth(tiny_model, ids_)
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(ids_) + 1  # the prompt's tokens, then the generated one
        assert np.allclose(lp.token_logprobs[1:len(ids_)], ref[np.arange(len(ids_) - 1), ids_[1:]], atol=ATOL)
        for pos in range(1, len(ids_)):  # keyed by token text: tokens whose text collides show once
            best = -np.sort(-ref[pos - 1])[:2]
            values = list(lp.top_logprobs[pos].values())
            assert max(values) == pytest.approx(best[0], abs=ATOL)
            assert all(min(abs(v - best)) < ATOL for v in values)
        # the echoed text is the prompt's, then the generated token's; offsets walk the tokens
        generated = greedy_truth(tiny_model, ids_, 1)
        assert choice.text == tok.decode(ids_ + generated, skip_special_tokens=False)
        assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1][generated[0]]), abs=ATOL)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    scored = out["texts"]  # text prompts, max_tokens 0: pure scoring; a text prompt echoes as given
    assert [c.text for c in scored.choices] == texts and scored.usage.completion_tokens == 0
    for ids_, choice in zip(prompts, scored.choices):
        ref = logprobs_truth(tiny_model, ids_)
        assert np.allclose(choice.logprobs.token_logprobs[1:], ref[np.arange(len(ids_) - 1), ids_[1:]], atol=ATOL)
        assert choice.finish_reason == "length"

    n2 = out["n2"]  # index = prompt index x n + choice
    assert [c.index for c in n2.choices] == list(range(6))
    for p, ids_ in enumerate(prompts):
        continuation = tok.decode(greedy_truth(tiny_model, ids_, 3))
        assert [n2.choices[2 * p + j].text for j in (0, 1)] == [texts[p] + continuation] * 2
    assert n2.usage.prompt_tokens == sum(map(len, prompts)) and n2.usage.completion_tokens == 18


async def test_streamed_echo_prompt_logprobs_and_tokenizer_info(tiny_model_path: Path,
                                                                tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    prompt = tok.encode("Once upon a time, there was a small model that learned to count")
    messages = [{"role": "user", "content": "What is two plus two?"}]
    async with running_server(TinyEngine(tiny_model_path)) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            r = await client.post("/v1/completions", json={
                "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 2, "temperature": 0, "stream": True,
                "ignore_eos": True, "prompt_logprobs": 3})
            events = parse_sse(r.content)
            chat = (await client.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 0, "prompt_logprobs": 1})).json()
            info = (await client.get("/tokenizer_info")).json()
        async with trio_websocket.open_websocket_url(serving.url.replace("http", "ws", 1) + "/v1/ws") as ws:
            await ws.send_message(json.dumps({"type": "generate", "id": 1, "prompt": [prompt, prompt[:5]],
                                              "echo": True, "logprobs": 0, "max_tokens": 0}))
            ws_messages = []
            while not ws_messages or ws_messages[-1]["type"] == "delta":
                ws_messages.append(json.loads(await ws.get_message()))
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            bad = [await client.post("/v1/completions", json={"prompt": "a", **body}) for body in (
                {"echo": True, "n": 2, "temperature": 0.7}, {"best_of": 2}, {"echo": True, "logprobs": 21},
                {"prompt_logprobs": 21}, {"max_tokens": 0})]
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    first = chunks[0]  # the echo, with the prompt's logprobs, comes with the choice's first chunk
    text = tok.decode(prompt, skip_special_tokens=False)
    assert first["text"].startswith(text)
    ref = logprobs_truth(tiny_model, prompt)
    token_logprobs = first["logprobs"]["token_logprobs"]
    assert token_logprobs[0] is None
    assert np.allclose(token_logprobs[1:len(prompt)], ref[np.arange(len(prompt) - 1), prompt[1:]], atol=ATOL)
    vllm = first["prompt_logprobs"]  # vLLM's format: {token id: {logprob, rank, decoded_token}}
    assert vllm[0] is None and len(vllm) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = vllm[pos]
        assert entry[str(prompt[pos])]["logprob"] == pytest.approx(float(ref[pos - 1][prompt[pos]]), abs=ATOL)
        assert len(entry) >= 3 and {e["rank"] for t, e in entry.items() if t != str(prompt[pos])} <= {1, 2, 3}
    assert "".join(c["text"] for c in chunks) == tok.decode(prompt + greedy_truth(tiny_model, prompt, 2),
                                                             skip_special_tokens=False)

    chat_ids = tok.apply_chat_template(messages)
    chat_ref = logprobs_truth(tiny_model, chat_ids)
    assert chat["choices"][0]["message"]["content"] == "" and chat["usage"]["completion_tokens"] == 0
    got = [None if e is None else e[str(t)]["logprob"] for e, t in zip(chat["prompt_logprobs"], chat_ids)]
    assert got[0] is None and np.allclose(got[1:], chat_ref[np.arange(len(chat_ids) - 1), chat_ids[1:]], atol=ATOL)

    # the websocket's deltas carry the echo the same way, one choice per prompt of the batch
    deltas = {m["index"]: m for m in ws_messages[:-1]}
    assert ws_messages[-1]["type"] == "done" and sorted(deltas) == [0, 1]
    for i, ids in enumerate((prompt, prompt[:5])):
        assert deltas[i]["text"] == tok.decode(ids, skip_special_tokens=False)
        ws_logprobs = deltas[i]["logprobs"]["token_logprobs"]
        assert ws_logprobs[0] is None and np.allclose(ws_logprobs[1:], ref[np.arange(len(ids) - 1), ids[1:]],
                                                      atol=ATOL)

    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 2048
    assert "<|im_start|>" in info["chat_template"] and "bos_token" in info and "pad_token" in info

    for r in bad:
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


# ---- lm-evaluation-harness itself ----

MC = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "label": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "label": 0},
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog", "moon", "fence, then rests"],
     "label": 0},
]
GEN = [{"question": "Hello world! Hello", "answer": " there"}, {"question": "def add(a, b):", "answer": " return"}]


def write_tasks(folder: Path) -> None:
    """A multiple-choice task and a generate_until task, as local YAML over local jsonl files."""
    for name, rows in (("mc", MC), ("gen", GEN)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"data_files": {"test": ""}, "cache_dir": str(folder / "cache")}
    (folder / "trillm_mc.yaml").write_text(json.dumps({
        "task": "trillm_mc", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {**data, "data_files": {"test": str(folder / "mc.jsonl")}},
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]}))
    (folder / "trillm_gen.yaml").write_text(json.dumps({
        "task": "trillm_gen", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {**data, "data_files": {"test": str(folder / "gen.jsonl")}},
        "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}]}))


def run_lm_eval(base_url: str, folder: Path, batch_size: int) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="local-completions",
        model_args={"base_url": base_url + "/v1/completions", "tokenizer_backend": "remote",
                    "tokenized_requests": True, "model": "tiny-llama"},
        tasks=["trillm_mc", "trillm_gen"], task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        batch_size=batch_size, log_samples=True, bootstrap_iters=0)
    assert results is not None
    return dict(results)


def encode_pair(model: LoadedModel, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's own split of (context, continuation) into tokens (TemplateLM._encode_pair), on our tokenizer."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = model.tokenizer.encode(context + continuation)
    ctx = model.tokenizer.encode(context)
    return ctx, whole[len(ctx):]


async def test_lm_eval_harness_loglikelihoods_equal_mlx_lm(tiny_model_path: Path, tiny_model: LoadedModel,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    write_tasks(tmp_path)
    async with running_server(TinyEngine(tiny_model_path, max_num_batched_tokens=16, max_num_seqs=8)) as serving:
        runs = {bs: await trio.to_thread.run_sync(run_lm_eval, serving.url, tmp_path, bs) for bs in (1, 4)}

    tok = tiny_model.tokenizer
    for bs, results in runs.items():
        samples = results["samples"]["trillm_mc"]
        assert len(samples) == len(MC)
        for sample in samples:
            for (context, continuation), (loglik, is_greedy) in zip(sample["arguments"], sample["filtered_resps"]):
                ctx, cont = encode_pair(tiny_model, context, continuation)
                ref = logprobs_truth(tiny_model, ctx + cont)
                rows = ref[np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)]
                assert loglik == pytest.approx(float(rows[np.arange(len(cont)), cont].sum()), abs=1e-3), bs
                assert is_greedy == all(int(np.argmax(r)) == t for r, t in zip(rows, cont))
        for sample, doc in zip(results["samples"]["trillm_gen"], GEN):
            context = sample["arguments"][0][0]
            ids = greedy_truth(tiny_model, tok.encode(context), 6)
            eos = [i for i, t in enumerate(ids) if t in tiny_model.eos_token_ids]
            text = tok.decode(ids[: eos[0]] if eos else ids).split("\n")[0]
            assert sample["resps"] == [[text]], bs
        assert results["results"]["trillm_mc"]["acc,none"] is not None
    one, four = ([r[0] for s in runs[bs]["samples"]["trillm_mc"] for r in s["filtered_resps"]] for bs in (1, 4))
    assert one == pytest.approx(four, abs=1e-3)
