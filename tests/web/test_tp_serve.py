"""`trillm serve --tensor-parallel N` and `mlx.launch ... trillm serve` as real processes on loopback: answers
equal one rank's; a rank killed or frozen mid-stream ends the streams with an error and turns /health 503
within a timeout; shutdown leaves no process behind (every process of a server carries a marker in its
environment, and none may remain)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tiny_model import build_tiny_model
from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.sampling_params import SamplingParams

BIN = Path(sys.executable).parent
MARKER_ENV = "TRILLM_TEST_MARKER"
LOGPROB_TOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def marked_pids(marker: str) -> list[int]:
    """Every live process whose environment carries the marker (children inherit it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{MARKER_ENV}={marker}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    if (entry / "stat").read_text().split()[2] != "Z":
                        pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


@contextmanager
def server(argv: list[str], tmp_path: Path, port: int) -> Iterator[tuple[subprocess.Popen[bytes], str, str, Path]]:
    """Start argv (in its own session) and wait until /health answers 200; on the way out, nothing may remain."""
    marker = uuid.uuid4().hex
    log = tmp_path / f"server-{marker[:8]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env={**os.environ, MARKER_ENV: marker}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: health(url) == 200 or proc.poll() is not None, 120, "the server to come up")
        assert proc.poll() is None, log.read_text()
        yield proc, url, marker, log
    except BaseException:
        print(log.read_text()[-8000:])
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in marked_pids(marker):
            os.kill(pid, signal.SIGKILL)


def stop(proc: subprocess.Popen[bytes], marker: str, sig: signal.Signals = signal.SIGTERM, *, group: bool = False) -> None:
    """Stop the server as a user would; it must exit, taking every rank with it."""
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    proc.wait(timeout=30)
    wait_for(lambda: not marked_pids(marker), 15, "every rank to exit")


def completion(url: str, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 1})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"]}


def reference(model: LoadedModel, prompts: list[list[int]], max_tokens: int = 8) -> list[dict[str, Any]]:
    engine = LLMEngine(EngineConfig(num_kv_blocks=256), loaded=model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=1)
    return [{"text": o.new_text, "logprobs": [lp.logprob for lp in o.logprobs or ()]}
            for o in engine.generate(prompts, params)]


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["text"] == w["text"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= LOGPROB_TOL


def stream_until_error(url: str, on_first_tokens: Any) -> tuple[int, list[dict[str, Any]]]:
    """Stream a long completion; call on_first_tokens() after three tokens; return (tokens, error events)."""
    body = {"prompt": "hello there", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    tokens, errors = 0, []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                errors.append(event["error"])
                continue
            tokens += 1
            if tokens == 3:
                on_first_tokens()
    return tokens, errors


def prompts(model: LoadedModel) -> list[list[int]]:
    enc = model.tokenizer.encode
    return [enc("hello"), enc("the quick brown fox jumps over the lazy dog " * 4), enc("a b c"), enc("0123 " * 9)]


def test_two_ranks_serve_like_one_then_a_killed_rank_fails_the_streams(
        tiny_model_path: Path, tiny_model: LoadedModel, tmp_path: Path) -> None:
    port = _free_port()
    argv = [str(BIN / "trillm"), "serve", "--tensor-parallel", "2", "--model", str(tiny_model_path),
            "--num-kv-blocks", "256", "--port", str(port), "--log-level", "warning"]
    ps = prompts(tiny_model)
    want = reference(tiny_model, ps)
    with server(argv, tmp_path, port) as (proc, url, marker, log):
        (worker,) = children(proc.pid)
        assert_same([completion(url, p) for p in ps], want)  # one at a time
        with ThreadPoolExecutor(len(ps)) as pool:  # batched (arriving together)
            assert_same(list(pool.map(lambda p: completion(url, p), ps)), want)

        t_kill = 0.0

        def kill_rank_1() -> None:
            nonlocal t_kill
            t_kill = time.monotonic()
            os.kill(worker, signal.SIGKILL)

        tokens, errors = stream_until_error(url, kill_rank_1)
        assert tokens >= 3 and len(errors) == 1 and errors[0]["code"] == "generation_failed"
        assert time.monotonic() - t_kill < 10
        wait_for(lambda: health(url) == 503, 10, "/health to report the model unhealthy")
        wait_for(lambda: "tensor-parallel rank 1 was killed by SIGKILL" in log.read_text(), 10, "the log to say why")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503  # refused at once, not hung
        stop(proc, marker)
        assert proc.returncode == 1  # the group failed


def test_a_frozen_rank_trips_the_timeout(tiny_model_path: Path, tmp_path: Path) -> None:
    port = _free_port()
    argv = [str(BIN / "trillm"), "serve", "--tensor-parallel", "2", "--model", str(tiny_model_path),
            "--num-kv-blocks", "256", "--tp-timeout", "1", "--kernels", "ref", "--port", str(port),
            "--log-level", "warning"]
    with server(argv, tmp_path, port) as (proc, url, marker, log):
        (worker,) = children(proc.pid)
        t_stop = 0.0

        def freeze_rank_1() -> None:
            nonlocal t_stop
            t_stop = time.monotonic()
            os.kill(worker, signal.SIGSTOP)

        tokens, errors = stream_until_error(url, freeze_rank_1)
        assert len(errors) == 1 and time.monotonic() - t_stop < 10
        wait_for(lambda: health(url) == 503, 10, "/health to report the model unhealthy")
        wait_for(lambda: "a tensor-parallel step has waited 1 s for the other ranks: one of them hangs" in log.read_text(),
                 10, "the log to say why")
        stop(proc, marker, signal.SIGINT)  # Ctrl-C
        assert proc.returncode == 1


def test_under_mlx_launch(tiny_model_path: Path, tiny_model: LoadedModel, tmp_path: Path) -> None:
    """`mlx.launch -n 2 -- trillm serve`: the ranks find their roles from mx.distributed; rank 0 serves."""
    port = _free_port()
    ring_port = _free_port()
    argv = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(ring_port), "--",
            str(BIN / "trillm"), "serve", "--model", str(tiny_model_path), "--num-kv-blocks", "256",
            "--port", str(port), "--log-level", "warning"]
    ps = prompts(tiny_model)[:2]
    with server(argv, tmp_path, port) as (proc, url, marker, _):
        assert len(marked_pids(marker)) >= 3  # the launcher and two ranks
        assert_same([completion(url, p) for p in ps], reference(tiny_model, ps))
        stop(proc, marker, signal.SIGINT, group=True)  # Ctrl-C in the launcher's terminal


def test_a_model_that_does_not_shard_is_refused(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "six-heads", hidden_size=96, num_heads=6, num_kv_heads=3,
                             intermediate_size=192)
    marker = uuid.uuid4().hex
    proc = subprocess.run([str(BIN / "trillm"), "serve", "--tensor-parallel", "2", "--model", str(model),
                           "--kernels", "ref", "--port", str(_free_port())], env={**os.environ, MARKER_ENV: marker},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert ("six-heads cannot be split over 2 ranks: its 3 KV heads do not divide by 2 (--tensor-parallel 3 would)"
            in proc.stderr.splitlines()[-1])
    wait_for(lambda: not marked_pids(marker), 15, "every rank to exit")


@pytest.mark.parametrize("flags", [["--mock"], ["--lazy-load"], ["--model", "a", "--model", "b"]])
def test_flags_that_do_not_mix_with_tensor_parallelism(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from trillm.web.cli import main

    assert main(["serve", "--tensor-parallel", "2", *flags]) == 2
    assert "tensor parallelism serves one model" in capsys.readouterr().err
