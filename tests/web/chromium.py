"""Headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium, for the browser tests.

`Page` runs every Selenium call in a worker thread: the server under test shares the test's trio loop, so a
blocking WebDriver call on the trio thread would stall the very server the browser is talking to.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

ARTIFACTS = Path(__file__).resolve().parents[2] / "results" / "playground"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,900")


def find_chromium() -> tuple[str, str] | str:
    """(browser, driver) paths, or why there are none."""
    browser = next((p for n in ("chromium", "chromium-browser") if (p := shutil.which(n))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return "no Chromium and chromedriver installed (Debian: apt-get install chromium chromium-driver)"
    return browser, driver


def start_chromium(browser: str, driver: str, profile: Path) -> WebDriver:
    options = webdriver.ChromeOptions()
    options.binary_location = browser  # given paths: Selenium Manager never looks for (or downloads) a browser
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))


class Page:
    """The one browser tab, driven from trio."""

    def __init__(self, driver: WebDriver) -> None:
        self.driver = driver

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(partial(fn, *args))

    async def js(self, script: str, *args: Any) -> Any:
        return await self.call(self.driver.execute_script, script, *args)

    async def open(self, url: str) -> None:
        await self.call(self.driver.get, url)

    async def wait_for(self, script: str, *args: Any, timeout: float = 10.0, poll: float = 0.02) -> Any:
        """The first truthy value of `script` (a JS function body), polled."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.js(script, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for: {script}")
            await trio.sleep(poll)

    async def type(self, element_id: str, text: str, *, clear: bool = True) -> None:
        def run() -> None:
            element = self.driver.find_element(By.ID, element_id)
            if clear:
                element.clear()
            element.send_keys(text)

        await self.call(run)

    async def click(self, element_id: str) -> None:
        await self.call(lambda: self.driver.find_element(By.ID, element_id).click())

    async def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        await self.call(self.driver.save_screenshot, str(path))
        print(f"screenshot: {path}")
        return path

    async def js_errors(self) -> list[str]:
        """Uncaught script errors logged since the last call (network failures such as a 401 are not)."""
        logs = await self.call(self.driver.get_log, "browser")
        return [e["message"] for e in logs if e.get("level") == "SEVERE" and e.get("source") == "javascript"]
