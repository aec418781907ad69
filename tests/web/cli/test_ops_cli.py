"""The operations flags of `trillm serve` (docs/operations.md lists each with its default) reach their configs."""

from __future__ import annotations

import pathlib
import re

import pytest

from trillm.engine.config import engine_config_from_args
from trillm.web.cli import build_parser, serve as cli_serve
from trillm.web.service import tracing

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "operations.md"


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


def test_the_docs_table_lists_real_flags_with_their_defaults() -> None:
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]+) \|", DOC.read_text(), re.M)
    assert len(rows) >= 7
    args = parse()
    for flag, default in rows:
        dest = flag[2:].replace("-", "_")
        value = getattr(args, dest)
        expected = {"off": None, "none": None}.get(default.strip(), default.strip().strip("`"))
        assert (value if value is None else str(value)) == expected, (flag, value, default)


def test_flags_reach_the_server_and_engine_configs(tmp_path: pathlib.Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("alice sk-alice-0123456789 rpm=5\nbob sk-bob-0123456789\n")
    args = parse("--request-timeout", "30", "--api-key-file", str(keys), "--key-max-concurrent", "3",
                 "--scheduling-policy", "priority", "--priority-aging", "8")
    config = cli_serve._server_config(args, ())
    assert config.request_timeout_s == 30.0
    assert [(k.name, k.rpm, k.max_concurrent) for k in config.api_keys] == [("alice", 5, 3), ("bob", None, 3)]
    engine = engine_config_from_args(args)
    assert engine.scheduling_policy == "priority" and engine.priority_aging == 8
    with pytest.raises(SystemExit):
        parse("--scheduling-policy", "lifo")
    keys.write_text("alice short\n")
    with pytest.raises(ValueError, match="api-key-file"):
        cli_serve._server_config(parse("--api-key-file", str(keys)), ())
    with pytest.raises(ValueError, match="request_timeout_s"):
        cli_serve._server_config(parse("--request-timeout", "0"), ())


def test_otlp_endpoint_configures_an_exporter() -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    try:
        cli_serve._server_config(parse("--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces"), ())
        assert tracing.enabled()
    finally:
        tracing.shutdown()  # nothing was exported: no request ran
        tracing.use_provider(None)
