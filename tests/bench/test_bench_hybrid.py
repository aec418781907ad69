"""`trillm bench engine --hybrid --hybrid-family`: the Mamba-2 families' models as asked for, and their profile."""

from __future__ import annotations

import argparse

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)

import mlx.core as mx  # noqa: E402

from trillm.bench.engine_hybrid import add_arguments, loaded, nemotron_h_pattern, ssm_model, ssm_profile  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(argv)


def test_family_option_defaults_to_qwen35_and_refuses_others() -> None:
    assert parse(["--hybrid"]).hybrid_family == "qwen3_5"
    assert parse(["--hybrid", "--hybrid-family", "nemotron_h"]).hybrid_family == "nemotron_h"
    with pytest.raises(SystemExit):
        parse(["--hybrid", "--hybrid-family", "mamba"])


def test_nemotron_h_pattern_puts_attention_every_interval_with_mlps_between() -> None:
    assert nemotron_h_pattern(6, 3) == "M-M-*-M-M-*-"
    assert nemotron_h_pattern(2, 4) == "M-M-"


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_ssm_model_has_the_mixer_shapes_and_its_profile_times_every_part(family: str) -> None:
    model, facts = ssm_model(family, 64, 2, 2, 49152)  # the default tokenizer's ids must embed
    blocks = list(model.layers)
    mixers = [b.mixer for b in blocks if hasattr(b.mixer, "A_log")]
    assert facts["num_hidden_layers"] == len(blocks) == (4 if family == "nemotron_h" else 2)
    assert len(mixers) == (1 if family == "nemotron_h" else 2)
    m = mixers[0]
    assert (m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups) == (32, 64, 128, 8)
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 49152)

    prof, parts = ssm_profile(model, loaded(model, facts), 2, iters=1, kernels="ref")  # no self-check
    assert set(parts) == {"ssm_update (mlx-lm)", "ssm_update (engine)", "in_proj", "conv1d", "norm + out_proj", "mlps", "lm_head"}
    assert all(v > 0 for k, v in parts.items() if k != "mlps")
    assert (parts["mlps"] > 0) == (family == "nemotron_h")
    assert prof.step_s > 0 and prof.mlx_lm_s == parts["ssm_update (mlx-lm)"] / 1e3
    assert prof.trillm_s == parts["ssm_update (engine)"] / 1e3
