"""Fixtures for the web tests: an EngineService around the fake engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from trillm.web.service import EngineService, ServiceConfig
from fake_engine import FakeEngine


class FakeFactory:
    """Builds FakeEngines (on the engine thread) and remembers them, so tests can poke the live one."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        self.engines: list[FakeEngine] = []

    def __call__(self) -> FakeEngine:
        engine = FakeEngine(**self.kw)
        self.engines.append(engine)
        return engine

    @property
    def engine(self) -> FakeEngine:
        return self.engines[-1]


@asynccontextmanager
async def running_service(factory: Callable[[], Any], **config: Any) -> AsyncIterator[EngineService]:
    async with trio.open_nursery() as nursery:
        service = await nursery.start(EngineService(factory, config=ServiceConfig(**config)).run)
        yield service
        nursery.cancel_scope.cancel()
