"""The engine's one frozen config, and the command-line flags that fill it (one place for both)."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from typing import Any

from trillm.engine.errors import InvalidRequest
from trillm.engine.memory import parse_memory_size
from trillm.kernels.selfcheck import MODES as KERNEL_MODES

SCHEDULING_POLICIES = ("fcfs", "priority")
# ngram: prompt lookup over the request's own tokens (engine/ngram.py); draft:PATH: a small model of the same
# tokenizer proposes (engine/spec_draft.py)
SPECULATIVE_METHODS = ("off", "ngram", "draft")
# --kv-cache-dtype -> the pool's dtype by name (auto: the model's; int8: int8 values beside float32 scales per
# token and KV head, trillm.kernels.layout)
# int4: two 4-bit values a byte beside a float32 (scale, min) per group of 32 along head_dim
KV_CACHE_DTYPES = {"auto": None, "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8",
                   "int4": "int4"}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str | None = None  # None / "quantized": keep the file's quantization (float32 compute on CPU)
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
    kernels: str = "auto"  # start-up kernel self-check: auto (fall back per op), strict (fail), ref (references)
    verify_model: bool = True  # at load, compare the paged forward with mlx-lm's own (engine/model_probe.py)
    allow_unverified_model: bool = False  # serve a model that fails that comparison anyway (loudly)
    # Waiting requests: "fcfs" ignores their `priority`; "priority" admits lower values first (vLLM's
    # semantics), aged so nothing starves: one step of priority is worth `priority_aging` rounds of the fair
    # queue's virtual time of head start (0: strict priority, which can starve the lower classes).
    scheduling_policy: str = "fcfs"
    priority_aging: int = 64
    # Speculative decoding in the continuous batch (engine/spec_decode.py): up to num_speculative_tokens proposed
    # tokens per decode row, verified in the step's forward; only while at most speculative_max_batch rows decode.
    speculative: str = "off"
    num_speculative_tokens: int = 8
    speculative_max_batch: int = 4
    # Hybrid models' prefix caching (engine/state_checkpoints.py): a recurrent-state checkpoint every this many
    # blocks (0: their sequences never hit the prefix cache), and how many are kept (None: 4 per sequence slot,
    # within a quarter of kv_cache_memory_gb), out of the KV memory budget.
    state_checkpoint_interval: int = 4
    max_state_checkpoints: int | None = None
    # Memory that follows the load (engine/kv_slabs.py, engine/memory.py): the pool grows by slabs of this
    # many MB up to its block count, within memory_limit bytes for the whole process (None: a fraction of the
    # machine); idle for kv_idle_release_s seconds, it shrinks to the slabs of its kv_idle_keep_mb most
    # recently used cached MB.
    memory_limit: int | None = None
    kv_slab_mb: float = 64.0
    kv_idle_release_s: float = 30.0
    kv_idle_keep_mb: float = 64.0
    # The KV pool's dtype (KV_CACHE_DTYPES): auto keeps the model's (float32 on CPU); int8 quarters float32's
    # bytes per token (plus a float32 scale per token and KV head).
    kv_cache_dtype: str = "auto"
    # The prefix cache's disk tier (engine/kv_disk.py): evicted blocks, and at close the cached ones, kept in
    # kv_cache_dir (None: no disk tier) within kv_cache_dir_gb GB per model and KV layout, least recently used
    # first; a later request or a restarted engine loads them instead of computing them.
    kv_cache_dir: str | None = None
    kv_cache_dir_gb: float = 10.0

    @property
    def speculative_method(self) -> str:
        """off, ngram or draft (`speculative` without its draft model's path)."""
        return self.speculative.partition(":")[0]

    @property
    def draft_model(self) -> str | None:
        """--speculative draft:PATH's model (a folder, a .gguf file or a Hugging Face repo id); else None."""
        method, _, path = self.speculative.partition(":")
        return path if method == "draft" else None

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
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequest(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                                 f"got {self.scheduling_policy!r}")
        if self.priority_aging < 0:
            raise InvalidRequest(f"priority_aging must be >= 0, got {self.priority_aging}")
        if self.state_checkpoint_interval < 0 or (self.max_state_checkpoints or 0) < 0:
            raise InvalidRequest("state_checkpoint_interval and max_state_checkpoints must be >= 0")
        method, _, path = self.speculative.partition(":")
        if method not in SPECULATIVE_METHODS or (method == "draft") != bool(path):
            raise InvalidRequest(f"speculative must be off, ngram or draft:PATH (a draft model of the same tokenizer), "
                                 f"got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequest(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.speculative_max_batch < 1:
            raise InvalidRequest(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if (self.memory_limit is not None and self.memory_limit <= 0) or self.kv_slab_mb <= 0:
            raise InvalidRequest("memory_limit and kv_slab_mb must be > 0")
        if self.kv_idle_release_s < 0 or self.kv_idle_keep_mb < 0:
            raise InvalidRequest("kv_idle_release_s and kv_idle_keep_mb must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequest(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                 f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dir_gb <= 0:
            raise InvalidRequest("kv_cache_dir_gb must be > 0")
        if self.kernels not in KERNEL_MODES:
            raise InvalidRequest(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")


# field -> (flag, help); booleans that default to True get a --no-... flag. The defaults are the dataclass's.
_FLAGS: dict[str, tuple[str, str]] = {
    "block_size": ("--block-size", "tokens per KV block"),
    "num_kv_blocks": ("--num-kv-blocks", "KV blocks (default: sized from --kv-cache-memory-gb)"),
    "kv_cache_memory_gb": ("--kv-cache-memory-gb", "memory for the KV cache, in GB"),
    "max_num_seqs": ("--max-num-seqs", "largest running batch"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "tokens per step; the prefill chunk"),
    "max_model_len": ("--max-model-len", "context length (default: the model's)"),
    "max_waiting": ("--max-waiting", "queued requests before 503 Overloaded"),
    "enable_prefix_caching": ("--no-prefix-caching", "disable the prefix cache"),
    "enable_chunked_prefill": ("--no-chunked-prefill", "prefill each prompt in one step"),
    "pipeline_decode": ("--no-pipeline-decode", "read each decode step back before queuing the next"),
    "dtype": ("--dtype", "quantized (the default: a quantized file's weights stay quantized; computed in float32 "
                         "on CPU, the checkpoint's dtype on GPU), or float32, float16 or bfloat16 (every weight "
                         "dequantized to it)"),
    "seed": ("--engine-seed", "seed of unseeded sampling"),
    "kernels": ("--kernels", "auto: check each kernel against its reference at start, fall back per op; "
                             "strict: fail at start instead; ref: run the references only"),
    "verify_model": ("--no-verify-model", "skip the load-time check of the paged forward against mlx-lm's own"),
    "allow_unverified_model": ("--allow-unverified-model",
                               "serve a model whose paged forward disagrees with mlx-lm's own (its output may be "
                               "wrong; logged and shown in /health)"),
    "scheduling_policy": ("--scheduling-policy", "fcfs: waiting requests in arrival order (fair between requests), "
                                                 "their priority ignored; priority: lower 'priority' values first"),
    "priority_aging": ("--priority-aging", "--scheduling-policy priority: rounds of admission one step of priority "
                                           "is worth, so lower classes wait a bounded time; 0: strict (can starve)"),
    "speculative": ("--speculative", "speculative decoding: ngram proposes each request's next tokens from its own "
                                     "prompt and output; draft:PATH runs a small model of the same tokenizer "
                                     "(a folder, .gguf or repo id) to propose them; either is verified in the "
                                     "batch's forward; off: none"),
    "num_speculative_tokens": ("--num-speculative-tokens", "--speculative: the most tokens proposed per row and step "
                                                           "(fewer while a row's proposals are rejected)"),
    "speculative_max_batch": ("--speculative-max-batch", "--speculative: speculate only while at most this many "
                                                         "requests decode (a larger batch already fills the compute)"),
    "memory_limit": ("--memory-limit", "memory for the whole process (12GB, 512MB, 8GiB; a plain number is GB): "
                                       "the KV pool grows only within it and requests past it get 503 with "
                                       "Retry-After (none: 90%% of what the process holds plus the available RAM; "
                                       "on a Mac, of Metal's recommended working set)"),
    "kv_slab_mb": ("--kv-slab-mb", "the KV pool grows in slabs of this many MB (geometrically, at least 1.5x)"),
    "kv_idle_release_s": ("--kv-idle-release-s", "seconds idle after which the KV pool shrinks; 0: at once"),
    "kv_idle_keep_mb": ("--kv-idle-keep-mb", "MB of the most recently used prefix cache an idle pool keeps"),
    "kv_cache_dtype": ("--kv-cache-dtype", "the KV cache's dtype: auto (the model's; float32 on CPU), fp32, fp16, "
                                           "bf16, or int8 (8-bit keys and values with a float32 scale per token "
                                           "and head: ~3.8x float32's tokens in the same memory at head_dim 64; "
                                           "on Metal/CUDA never run on a GPU yet), or int4 (4-bit, a float32 "
                                           "scale and minimum per 32 values: ~5.3x float32's tokens; the "
                                           "attention kernels decode it as they read (on Metal/CUDA never run "
                                           "on a GPU yet), and lossy: see docs/performance.md)"),
    "kv_cache_dir": ("--kv-cache-dir", "a folder for the prefix cache's disk tier: evicted blocks (and at shutdown "
                                       "the cached ones) are written there and loaded by later requests, also "
                                       "after a restart (default: none, no disk tier)"),
    "kv_cache_dir_gb": ("--kv-cache-dir-gb", "--kv-cache-dir: GB of blocks kept per model and KV layout, least "
                                             "recently used evicted first"),
}


def _default(name: str) -> Any:
    f = next(f for f in fields(EngineConfig) if f.name == name)
    return None if f.default is MISSING else f.default


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, as a group of `parser`; read them back with `engine_config_from_args`."""
    g = parser.add_argument_group("engine")
    for name, (flag, help_text) in _FLAGS.items():
        default = _default(name)
        if isinstance(default, bool):
            g.add_argument(flag, dest=name, action="store_false" if default else "store_true", help=help_text)
        else:
            kind: Any = {"dtype": str, "kernels": str, "scheduling_policy": str, "speculative": str,
                         "kv_cache_dtype": str, "kv_cache_dir": str, "kv_cache_dir_gb": float,
                         "kv_cache_memory_gb": float, "kv_idle_release_s": float, "kv_slab_mb": float,
                         "kv_idle_keep_mb": float,
                         "memory_limit": parse_memory_size}.get(name, int)
            choices = {"kernels": KERNEL_MODES, "scheduling_policy": SCHEDULING_POLICIES,
                       "kv_cache_dtype": tuple(KV_CACHE_DTYPES)}.get(name)
            g.add_argument(flag, dest=name, type=kind, default=default, help=f"{help_text} (default: {default})",
                           choices=choices)


def engine_config_from_args(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    return EngineConfig(model=model, **{name: getattr(args, name) for name in _FLAGS})
