"""Traces (mooncake JSONL) and the mock tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from trillm.engine.mock.tokenizer import NUM_SPECIAL, MockTokenizer
from trillm.engine.mock.trace import TraceRequest, load_trace, prompt_tokens, save_trace, synthetic_trace


def test_tokenizer_decode_encode_roundtrip_and_sizes() -> None:
    tok = MockTokenizer(49152)
    ids = list(range(NUM_SPECIAL, 2000)) + list(range(40000, 49152, 7))
    text = tok.decode(ids)
    assert tok.encode(text) == ids
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.encode("<|im_start|> hi <|im_end|>")[::2] == [1, 2]
    assert all(NUM_SPECIAL <= i < tok.vocab_size for i in tok.encode("Any Text, at all! 123"))


def test_trace_roundtrip_and_validation(tmp_path: Path) -> None:
    trace = synthetic_trace(num_requests=50, rate=5.0, seed=3)
    save_trace(tmp_path / "t.jsonl", trace)
    assert load_trace(tmp_path / "t.jsonl") == trace
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": 0, "output_length": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")


def test_shared_hash_ids_share_prompt_prefixes() -> None:
    a = TraceRequest(0, 40, 4, (7, 8, 100))
    b = TraceRequest(0, 40, 4, (7, 8, 200))
    pa, pb = (prompt_tokens(r, i, vocab_size=1000, block_tokens=16) for i, r in enumerate((a, b)))
    assert len(pa) == len(pb) == 40
    assert pa[:32] == pb[:32] and pa[32:] != pb[32:]
    # input longer than its hash ids: padded with tokens unique to the request
    c = TraceRequest(0, 20, 4, (7,))
    pc = prompt_tokens(c, 2, vocab_size=1000, block_tokens=16)
    assert pc[:16] == pa[:16] and len(pc) == 20


def test_synthetic_trace_rate_and_determinism() -> None:
    t1 = synthetic_trace(duration_s=200, rate=4.0, seed=1)
    assert t1 == synthetic_trace(duration_s=200, rate=4.0, seed=1)
    assert 700 < len(t1) < 900  # Poisson(800)
    assert all(x.timestamp <= y.timestamp for x, y in zip(t1, t1[1:]))
    assert all(x.timestamp < 200_000 for x in t1)
