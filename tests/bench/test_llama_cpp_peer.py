"""llama.cpp as bench peers' optional peer: the F32 GGUF it serves, and the peer's run end to end (against a
stand-in `llama_cpp.server` module, since building llama-cpp-python takes minutes and is not part of set-up)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize
from mlx.utils import tree_flatten
from tiny_model import tiny_model_to_gguf

from trillm.bench import cli, llama_cpp
from trillm.engine.gguf import load_gguf

FAKE = Path(__file__).parent / "fake_llama_cpp"


def _requantize(src: Path, dest: Path) -> Path:
    """src with every 2-D tensor whose rows split into 32-wide blocks as Q4_1 (the default model's type)."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dest, arch=str(reader.fields["general.architecture"].contents()))
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    writer.add_file_type(int(LlamaFileType.MOSTLY_Q4_1))
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if data.ndim == 2 and data.shape[1] % 32 == 0:
            writer.add_tensor(t.name, quantize(data, GGMLQuantizationType.Q4_1),
                              raw_dtype=GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@pytest.fixture(scope="module")
def q4_gguf(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama-cpp")
    return _requantize(tiny_model_to_gguf(tiny_model_path, d / "tiny.F32.gguf"), d / "tiny.Q4_1.gguf")


def test_export_f32_gguf_keeps_every_weight_and_all_metadata(q4_gguf: Path, tmp_path: Path) -> None:
    out = llama_cpp.export_f32_gguf(q4_gguf, tmp_path / "tiny.f32.gguf")
    src, dst = GGUFReader(q4_gguf), GGUFReader(out)
    assert GGMLQuantizationType.Q4_1 in {t.tensor_type for t in src.tensors}  # the test quantized something
    assert {t.tensor_type for t in dst.tensors} == {GGMLQuantizationType.F32}
    assert dst.fields["general.file_type"].contents() == int(LlamaFileType.ALL_F32)
    meta = lambda r: {k: f.contents() for k, f in r.fields.items()  # noqa: E731
                      if not k.startswith("GGUF.") and k != "general.file_type"}
    assert meta(dst) == meta(src)  # tokenizer, chat template and hyper-parameters as they were
    # trillm's own GGUF loader (tested against mlx-lm) dequantizes the Q4_1 file to the same fp32 weights
    a = load_gguf(str(q4_gguf), keep_quantized=False, dtype=mx.float32)
    b = load_gguf(str(out), keep_quantized=False, dtype=mx.float32)
    wa, wb = dict(tree_flatten(a.model.parameters())), dict(tree_flatten(b.model.parameters()))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert mx.array_equal(wa[k], wb[k]), k
    assert a.tokenizer.encode("def add(a, b):") == b.tokenizer.encode("def add(a, b):")
    stamp = out.stat().st_mtime_ns
    assert llama_cpp.export_f32_gguf(q4_gguf, out) == out and out.stat().st_mtime_ns == stamp  # cached


def test_command_has_the_flags_the_issue_names() -> None:
    cmd = llama_cpp.llama_cpp_command("/py", "/m.gguf", 8123, threads=2)
    assert cmd[:3] == ["/py", "-m", "llama_cpp.server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {"--model": "/m.gguf", "--host": "127.0.0.1", "--port": "8123", "--n_ctx": "4096",
                     "--n_threads": "2", "--n_threads_batch": "2", "--interrupt_requests": "False"}
    assert llama_cpp.CMAKE_ARGS.split() == ["-DGGML_AMX=OFF", "-DGGML_OPENMP=OFF"]


def test_llama_server_command_runs_parallel_slots_on_the_given_threads() -> None:
    cmd = llama_cpp.llama_server_command("/opt/llama-server", "/m.gguf", 8123, parallel=32, threads=2)
    assert cmd[0] == "/opt/llama-server" and cmd[-1] == "--no-webui"
    flags = dict(zip(cmd[1:-1:2], cmd[2:-1:2]))
    assert flags == {"-m": "/m.gguf", "--host": "127.0.0.1", "--port": "8123", "-c": str(4096 * 32),
                     "--parallel": "32", "-t": "2", "-tb": "2"}


def test_peers_with_a_missing_llama_server_fails_loudly(tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--llama-server .* is not an executable file"):
        cli.main(["peers", "--model", str(tiny_model_path), "--llama-cpp", "on", "--llama-server",
                  str(tmp_path / "llama-server"), "--llama-cpp-gguf", str(tmp_path / "m.gguf"), "--skip-mlx-lm",
                  "--results-dir", str(tmp_path), "--only", "single"])


def test_find_python_without_llama_cpp_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp, "CACHE_ROOT", tmp_path)
    monkeypatch.delenv(llama_cpp.PYTHON_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", "")
    if llama_cpp.has_server(sys.executable):
        pytest.skip("this interpreter has llama-cpp-python")
    assert llama_cpp.find_python() is None
    assert llama_cpp.find_python(sys.executable) is None


def test_peers_with_llama_cpp_on_fails_loudly_without_it(tiny_model_path: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp, "CACHE_ROOT", tmp_path)
    monkeypatch.delenv(llama_cpp.PYTHON_ENV, raising=False)
    if llama_cpp.has_server(sys.executable):
        pytest.skip("this interpreter has llama-cpp-python")
    with pytest.raises(SystemExit, match="--llama-cpp on: no interpreter"):
        cli.main(["peers", "--model", str(tiny_model_path), "--llama-cpp", "on", "--llama-cpp-gguf",
                  str(tmp_path / "m.gguf"), "--skip-mlx-lm", "--results-dir", str(tmp_path), "--only", "single"])
    with pytest.raises(SystemExit, match="--llama-cpp on: --model was given without --llama-cpp-gguf"):
        cli.main(["peers", "--model", str(tiny_model_path), "--llama-cpp", "on", "--skip-mlx-lm",
                  "--results-dir", str(tmp_path), "--only", "single"])


def test_peers_runs_llama_cpp_on_the_f32_gguf_and_reports_its_ratios(
    tiny_model_path: Path, q4_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stand-in module is found through PYTHONPATH, as an interpreter with llama-cpp-python would find it.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FAKE), os.environ.get("PYTHONPATH")) if p))
    f32 = llama_cpp.export_f32_gguf(q4_gguf, tmp_path / "tiny.f32.gguf")
    rc = cli.main([
        "peers", "--model", str(tiny_model_path), "--llama-cpp", "on", "--llama-cpp-python", sys.executable,
        "--llama-cpp-gguf", str(f32), "--skip-mlx-lm", "--only", "concurrency", "--only", "single",
        "--only", "prefill", "--high-concurrency", "4", "--high-prompts", "4", "--single-prompts", "2",
        "--input-len", "16", "--output-len", "4", "--prefill-prompts", "1", "--prefill-len", "32",
        "--warmup", "1", "--results-dir", str(tmp_path / "results"), "--no-progress", "--startup-timeout", "180",
    ])
    assert rc == 0
    (out,) = [p for p in (tmp_path / "results").iterdir() if p.is_dir()]
    doc = json.loads((out / "peers.json").read_text())
    runs = {(r["workload"], r["server"]): r["summary"] for r in doc["runs"]}
    for wl in ("random", "long-prompt"):
        s = runs[(wl, "llama.cpp")]
        assert s["failed"] == 0 and s["completed"] > 0 and s["output_throughput"] > 0, s
    assert "--interrupt_requests" in doc["commands"]["llama.cpp"]
    targets = {(t["workload"], t["metric"]): t for t in json.loads((out / "targets.json").read_text())}
    single = targets[("single-stream", "output tok/s, trillm / llama.cpp")]
    assert single["ratio"] is not None and single["passed"] is not None  # the stretch goal is checked
    for key in (("high-concurrency", "output tok/s, trillm / llama.cpp"),
                ("high-concurrency", "TTFT p90 ms, trillm / llama.cpp"),
                ("long-prompt", "TTFT mean ms, llama.cpp / trillm")):
        assert targets[key]["ratio"] is not None and targets[key]["passed"] is None  # reported
    assert "| reported |" in (out / "peers.md").read_text()
    assert "stand-in llama.cpp" in (out / "llama_cpp_server.log").read_text()
