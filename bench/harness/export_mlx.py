"""Export a GGUF model (default: SmolLM2-135M-Instruct) to an fp32 HF-style MLX folder for mlx_lm.server.

The folder is what both servers load in `trillm bench peers`, so they serve identical weights. It is cached
under ~/.cache/trillm/mlx/ keyed by the GGUF's name and size; a complete folder is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import trillm.kernels  # noqa: F401  (BLAS before mlx)

CACHE_ROOT = Path(os.environ.get("TRILLM_CACHE", Path.home() / ".cache" / "trillm")) / "mlx"
_DONE = ".trillm-export-complete"


def export_gguf(gguf: str | os.PathLike[str] | None = None, dest: Path | None = None, dtype: str = "float32") -> Path:
    """Write model.safetensors, config.json and the tokenizer files; returns the folder (cached)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from trillm.engine.gguf import load_gguf
    from trillm.engine.loader import _DTYPES, default_model_path

    src = Path(gguf or default_model_path())
    if dest is None:
        dest = CACHE_ROOT / f"{src.stem}-{src.stat().st_size}-{dtype}"
    if (dest / _DONE).is_file():
        return dest
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = load_gguf(src, keep_quantized=False, dtype=_DTYPES[dtype])
    weights = dict(tree_flatten(g.model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {k: v for k, v in g.config.items() if k not in ("quantization", "quantization_config")}
    config.setdefault("model_type", "llama")
    config["torch_dtype"] = dtype
    eos = sorted(g.tokenizer.eos_token_ids)
    config.setdefault("eos_token_id", eos[0] if len(eos) == 1 else eos)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    g.tokenizer.hf.save_pretrained(str(tmp))
    (tmp / _DONE).write_text(str(src))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trillm bench export-mlx", description=__doc__)
    p.add_argument("gguf", nargs="?", default=None, help="GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = p.parse_args(argv)
    print(export_gguf(args.gguf, args.out, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
