"""The page at / in a real headless Chromium (selenium): it streams a completion, draws S with
the future exactly 0 and rows summing to 1, and shows causality hold: replacing token j leaves
every next-token distribution before j exactly unchanged."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

DRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser():
    if DRIVER is None:  # .ci/run installs Debian's chromium and chromium-driver
        pytest.skip("chromedriver is not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1200,1800",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def test_the_page_streams_shows_causal_attention_and_causality(server, browser, tmp_path: Path):
    wait = WebDriverWait(browser, 120)  # conditions on the page, polled; no fixed sleeps
    browser.get(server)
    wait.until(lambda b: "layers" in b.find_element(By.ID, "model").text)
    assert "first 32 tokens" in browser.find_element(By.ID, "cap").text  # the stated cap

    browser.find_element(By.ID, "max_tokens").clear()
    browser.find_element(By.ID, "max_tokens").send_keys("12")
    browser.find_element(By.ID, "generate").click()
    status = browser.find_element(By.ID, "status")
    wait.until(lambda b: status.get_attribute("data-state") in ("done", "failed"))
    assert status.text.startswith("done: 12 tokens"), status.text
    assert browser.find_element(By.ID, "completion").text

    browser.find_element(By.ID, "show").click()
    wait.until(lambda b: b.find_element(By.ID, "attention").get_attribute("data-state") == "ready")
    cells = browser.execute_script(
        "return [...document.querySelectorAll('#heatmap .cell')]"
        ".map(c => [Number(c.dataset.i), Number(c.dataset.j), Number(c.dataset.p), c.className])"
    )
    T = round(len(cells) ** 0.5)
    assert len(cells) == T * T and T > 12
    rows = [0.0] * T
    for i, j, p, kind in cells:
        if j > i:
            assert p == 0 and kind == "cell masked"  # the future: exactly 0, drawn hatched
        rows[i] += p
    assert all(abs(total - 1) < 1e-4 for total in rows)  # 6 decimals a weight
    assert len(browser.find_elements(By.CSS_SELECTOR, "#multiples canvas")) == 2  # a layer each
    last = [(p, j) for i, j, p, _ in cells if i == T - 1]  # the query row shown
    darkest = f"#heatmap .cell[data-i='{T - 1}'][data-j='{max(last)[1]}']"
    colour = "return getComputedStyle(document.querySelector(arguments[0])).backgroundColor"
    assert browser.execute_script(colour, darkest) == "rgb(8, 29, 88)"  # its row's largest: 1
    browser.find_element(By.ID, "rowscale").click()  # off: the 0-to-1 scale
    assert browser.execute_script(colour, darkest) != "rgb(8, 29, 88)"
    weights = browser.find_element(By.ID, "weights").text  # position "token": weight, ...
    assert re.match(
        rf'token {T - 1} \(.*\) attends to: \d+ ".*": \d\.\d{{3}}(, \d+ ".*": )?', weights
    )

    browser.find_elements(By.CSS_SELECTOR, "#tokens span")[5].click()  # sets the position
    browser.find_element(By.ID, "replace").click()
    before = wait.until(lambda b: b.find_elements(By.ID, "before"))[0]
    assert float(before.get_attribute("data-value")) == 0.0
    assert "exactly 0" in browser.find_element(By.ID, "causality").text
    assert float(browser.find_element(By.ID, "after").get_attribute("data-value")) > 0
    browser.save_screenshot(str(tmp_path / "page.png"))
