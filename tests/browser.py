"""A real headless Chromium for the UI tests, through Selenium: Debian's `chromium` and
`chromedriver` (`apt-get install chromium chromium-driver`), never a downloaded browser.
Importing this module skips the importing test module when they are missing, unless
BERTH_REQUIRE_BROWSER=1 (CI), where it fails. `browser_fixture` is the module-scoped
`browser` fixture; `until` polls the page, `shot` saves a screenshot of it to
BERTH_TEST_ARTIFACTS (default tests/artifacts/)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(
    os.environ.get("BERTH_TEST_ARTIFACTS") or Path(__file__).resolve().parent / "artifacts"
)
TIMEOUT_S = 30  # the pages refresh every 5 s; a first render takes well under a second


def _browser_missing() -> str | None:
    if shutil.which("chromium") is None:
        return "no chromium (apt-get install chromium chromium-driver)"
    if not CHROMEDRIVER.exists():
        return f"no {CHROMEDRIVER} (apt-get install chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "no selenium (pip install -e '.[dev]')"
    return None


MISSING = _browser_missing()
if MISSING is not None:
    if os.environ.get("BERTH_REQUIRE_BROWSER") == "1":
        pytest.fail(f"BERTH_REQUIRE_BROWSER=1 but {MISSING}", pytrace=False)
    pytest.skip(MISSING, allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402, F401 (for the tests)


@pytest.fixture(scope="module", name="browser")
def browser_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which("chromium"))
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        # No network here: without these Chromium's own background connections are refused.
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1360,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def until(driver: WebDriver, find: Callable[[], Any], what: str) -> Any:
    """`find()`'s first truthy answer, polled; the page's text and console on a timeout."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        got = find()
        if got:
            return got
        if time.monotonic() > deadline:
            body = driver.find_element(By.TAG_NAME, "body").text[:3000]
            console = [e["message"] for e in driver.get_log("browser")][-20:]
            raise AssertionError(f"{what}: not seen in {TIMEOUT_S} s\n{body}\n{console}")
        time.sleep(0.2)


def shot(driver: WebDriver, name: str) -> Path:
    """A screenshot of the whole page (the window grown to its height) into ARTIFACTS."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    width = driver.get_window_size()["width"]
    driver.set_window_size(width, min(max(int(height) + 140, 600), 4000))
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(width, 900)
    return path
