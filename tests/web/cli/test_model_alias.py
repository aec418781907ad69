"""--model-alias: agents' own model names (globs allowed) reach a served model; unknown names stay a 404."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from trillm.web.cli import build_parser
from trillm.web.cli.serve import parse_model_aliases, run
from trillm.web.errors import to_api_error
from trillm.web.service.registry import ModelNotFound, ModelRegistry

from conftest import MockFactory, running_server


class Named:
    def __init__(self, name: str) -> None:
        self.model_name = name


def registry(*aliases: tuple[str, str]) -> ModelRegistry:
    services: list[Any] = [Named("small"), Named("big")]
    return ModelRegistry(services, aliases)


def test_exact_names_first_then_aliases_in_order() -> None:
    reg = registry(("claude-*haiku*", "small"), ("claude-*", "big"), ("gpt-4o", "small"))
    assert reg.select(None).model_name == "small"
    assert reg.select("big").model_name == "big"
    assert reg.select("claude-3-5-haiku-20241022").model_name == "small"
    assert reg.select("claude-sonnet-4-5").model_name == "big"
    assert reg.select("gpt-4o").model_name == "small"
    for unknown in ("gpt-4o-mini", "Claude-sonnet", "", 5):
        with pytest.raises(ModelNotFound) as info:
            reg.select(unknown)
        assert to_api_error(info.value).status == 404


def test_an_alias_to_a_model_not_served_fails_at_start() -> None:
    with pytest.raises(ValueError, match="no served model is named 'huge'"):
        registry(("claude-*", "huge"))


def test_flag_syntax() -> None:
    assert parse_model_aliases(["claude-*=m", " a = b "]) == (("claude-*", "m"), ("a", "b"))
    for bad in ("claude", "=m", "a=", "a= "):
        with pytest.raises(ValueError, match="NAME=SERVED"):
            parse_model_aliases([bad])


def test_serve_refuses_bad_aliases_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--mock", "--served-model-name", "m", "--model-alias", "claude-*=other"])
    assert run(args) == 2
    assert "no served model is named 'other'" in capsys.readouterr().err
    args = parser.parse_args(["serve", "--mock", "--model-alias", "claude"])
    assert run(args) == 2
    assert "NAME=SERVED" in capsys.readouterr().err


async def test_aliases_apply_to_every_endpoint() -> None:
    async with running_server(MockFactory(), model_aliases=(("claude-*", "mock-model"),)) as serving:
        async with httpx.AsyncClient(base_url=serving.url) as client:
            chat = await client.post("/v1/chat/completions", json={
                "model": "claude-opus-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            unknown = await client.post("/v1/messages", json={
                "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == "mock-model"
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"

def test_an_alias_checked_once_the_models_load_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from trillm.bench.harness.servers import free_port

    # No --served-model-name: the mock's name is known only once it loaded, so the alias is checked then.
    args = build_parser().parse_args(["serve", "--mock", "--port", str(free_port()), "--model-alias", "claude-*=other"])
    assert run(args) == 1
    err = capsys.readouterr().err
    assert "trillm serve: --model-alias claude-*=other: no served model is named 'other'" in err
    assert "Traceback" not in err
