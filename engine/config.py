"""The engine's one frozen config."""

from __future__ import annotations

from dataclasses import dataclass

from trillm.engine.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype on GPU
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget; also the prefill chunk size
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's context length
    max_waiting: int = 1024  # bounded waiting queue; past it add_request raises Overloaded
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds unseeded sampling
    pipeline_decode: bool = True  # queue decode step n+1 before reading step n back

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequest(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise InvalidRequest(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise InvalidRequest(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidRequest("max_num_batched_tokens must be >= max_num_seqs (one decode token per sequence)")
        if self.max_waiting < 0:
            raise InvalidRequest(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.kv_cache_memory_gb <= 0:
            raise InvalidRequest("kv_cache_memory_gb must be > 0")
