"""The page at / in a real headless Chromium (selenium): it streams a completion, draws S with
the future exactly 0 and rows summing to 1, and shows causality hold: replacing token j leaves
every next-token distribution before j exactly unchanged."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest
import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from checkpoints.store import save_checkpoint
from model import GPT, GPTConfig
from tests.inference.conftest import request
from tests.inference.test_chat import MESSAGES, save_chat_model, serve_url

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
    formula_view_shows_the_apis_numbers(browser, server, tmp_path)


FLOW = ["X", "Q", "K", "V", "QK", "scaled", "masked", "S", "S", "V", "Y", "heads", "out"]
# JavaScript: the colour of cell (i, j) of the first canvas of `step`, at its centre
PIXEL = """const [step, i, j] = arguments;
const c = document.querySelector(`#steps canvas[data-step=${step}]`);
const [w, h] = JSON.parse(c.dataset.cell), [left, top] = JSON.parse(c.dataset.origin);
const x = left + j * w + (w >> 1), y = top + i * h + (h >> 1);
return [...c.getContext("2d").getImageData(x, y, 1, 1).data].slice(0, 3);"""
CANVASES = "return [...document.querySelectorAll('#steps canvas')]"
HATCH = ([255, 255, 255], [187, 187, 187])  # the masked triangle's two pixel colours


def formula_view_shows_the_apis_numbers(browser, url: str, tmp_path: Path) -> None:
    """The formula view, after the attention view: its steps in rows that read as the formula,
    the masked triangle hatched, and the numbers /api/formula gives (asked here independently)
    read back from the drawing and the DOM: a hovered cell, a chosen row's computation, the
    sqrt(d_k) panel."""
    wait = WebDriverWait(browser, 120)
    dom = browser.execute_script
    browser.find_element(By.ID, "formula_show").click()
    wait.until(lambda b: b.find_element(By.ID, "formula").get_attribute("data-state") == "ready")
    steps = dom("return [...document.querySelectorAll('#steps canvas')].map(c => c.dataset.step)")
    assert steps == FLOW  # no qk_norm, no rope
    body = dom(
        "return {ids: view.ids, layer: Number($('layer').value), head: Number($('head').value)}"
    )
    T = len(dom("return view.ids"))
    _, _, api = request(url, "POST", "/api/formula", {**body, "row": T - 1})
    for i in range(T):
        for j in range(T):
            hatched = dom(PIXEL, "masked", i, j) in HATCH
            assert hatched == (j > i) == (api["steps"]["masked"][i][j] is None), (i, j)
    canvas = browser.find_element(By.CSS_SELECTOR, "#steps canvas[data-step=S]")
    (w, h), (left, top) = (
        json.loads(canvas.get_attribute("data-cell")),
        [json.loads(canvas.get_attribute("data-origin"))[k] for k in (0, 1)],
    )
    size = canvas.size
    x, y = left + w // 2 - size["width"] // 2, top + (T - 1) * h + h // 2 - size["height"] // 2
    ActionChains(browser).move_to_element_with_offset(canvas, x, y).perform()
    hover = wait.until(lambda b: b.find_element(By.ID, "formula_hover").text)
    assert hover.startswith(f"S[{T - 1}][0] = exp(")  # "... / sum over keys 0..T-1 = <S>"
    assert float(hover.rsplit("= ", 1)[1]) == pytest.approx(api["steps"]["S"][T - 1][0], rel=1e-3)

    browser.find_elements(By.CSS_SELECTOR, "#tokens span")[4].click()  # query 4's row
    wait.until(lambda b: b.execute_script("return formula.row.i") == 4)
    _, _, api = request(url, "POST", "/api/formula", {**body, "row": 4})
    table = dom(
        "return [...document.querySelectorAll('#row_table tr')]"
        ".map(r => [...r.children].map(c => c.textContent))"
    )
    assert [row[:2] for row in table[1:]] == [
        [str(j), json.dumps(t, ensure_ascii=False)] for j, t in enumerate(api["tokens"][:5])
    ]
    assert [float(row[5]) for row in table[1:]] == pytest.approx(api["row"]["weights"], rel=1e-3)
    assert [float(row[2]) for row in table[1:]] == pytest.approx(api["row"]["dots"], rel=1e-3)
    var_raw = float(browser.find_element(By.ID, "var_raw").text)
    assert var_raw == pytest.approx(api["sqrt_dk"]["var_raw"], rel=1e-2)
    shares = dom(
        "return [...document.querySelectorAll('#shares figure')].map(f => Number(f.dataset.share))"
    )
    assert shares == pytest.approx(api["heads"]["shares"])
    browser.execute_script("document.getElementById('formula_view').scrollIntoView()")
    browser.save_screenshot(str(tmp_path / "formula.png"))
    # one token (issue 55 item 3; it was a JavaScript error and empty panels): the panel says
    # why there is no variance, and every head's share is still drawn
    dom("$('formula').dataset.state = ''; view = {...view, ids: view.ids.slice(0, 1)}; query = 0")
    browser.find_element(By.ID, "formula_show").click()
    wait.until(lambda b: b.find_element(By.ID, "formula").get_attribute("data-state") == "ready")
    assert "one token has one score" in browser.find_element(By.ID, "sqrt_dk").text
    assert len(dom("return [...document.querySelectorAll('#shares figure')]")) == len(shares)


def test_the_chat_panel_answers_and_draws_s_over_the_conversation(
    serve_in_process, browser, tmp_path: Path
):
    """A chat model's page: the panel streams the reply /v1/chat/completions gives, then draws S
    over system, user and assistant turns, each turn's start marked in rows, columns and tokens.
    The Generate panel's settings are not the chat's (issue 55: its stop cut a chat reply)."""
    run = save_chat_model(tmp_path / "run")
    url = serve_url(serve_in_process, run)
    expected = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    answer = expected.chat.completions.create(
        model="chat", messages=MESSAGES[:2], temperature=0, max_tokens=8
    )
    wait = WebDriverWait(browser, 120)
    browser.get(url)
    wait.until(lambda b: b.find_element(By.ID, "chat").is_displayed())
    browser.find_element(By.ID, "stop").send_keys(answer.choices[0].message.content[1:3])
    browser.find_element(By.ID, "chat_max_tokens").clear()  # the chat panel's own settings
    browser.find_element(By.ID, "chat_max_tokens").send_keys("8")
    browser.find_element(By.ID, "chat_temperature").clear()
    browser.find_element(By.ID, "chat_temperature").send_keys("0")
    browser.find_element(By.ID, "system").send_keys(MESSAGES[0]["content"])
    browser.find_element(By.ID, "message").send_keys(MESSAGES[1]["content"])
    browser.find_element(By.ID, "send").click()
    status = browser.find_element(By.ID, "chat_status")
    wait.until(lambda b: status.get_attribute("data-state") in ("done", "failed"))
    assert status.text.startswith("done: 8 tokens, finish_reason length"), status.text
    reply = browser.find_elements(By.CSS_SELECTOR, "#conversation p.assistant")[0].text
    assert len(answer.choices[0].message.content) >= 3  # so the stop above would have cut it
    assert reply == "assistant" + answer.choices[0].message.content  # the role, then the text

    wait.until(lambda b: b.find_element(By.ID, "attention").get_attribute("data-state") == "ready")
    spans = "[...document.querySelectorAll('#tokens span')]"
    tokens = browser.execute_script(f"return {spans}.map(s => [s.textContent, s.className])")
    ids = browser.execute_script("return view.ids")  # what /api/attention answered
    starts = [i for i, token in enumerate(ids) if token == 50257]  # <|im_start|>: three turns
    assert len(starts) == 3 and len(tokens) == len(ids)
    assert [i for i, (_, kind) in enumerate(tokens) if "turn" in kind] == starts
    T = len(tokens)
    rows = "[...document.querySelectorAll('#heatmap .cell.turn-row')]"
    marked = browser.execute_script(f"return {rows}.map(c => Number(c.dataset.i))")
    assert sorted(set(marked)) == starts and len(marked) == sum(i + 1 for i in starts)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#heatmap .cell")) == T * T

    browser.find_element(By.ID, "formula_show").click()  # the formula over the conversation
    wait.until(lambda b: b.find_element(By.ID, "formula").get_attribute("data-state") == "ready")
    assert browser.execute_script("return formula.ids") == ids
    hatched = [
        [browser.execute_script(PIXEL, "masked", i, j) in HATCH for j in range(T)] for i in range(T)
    ]
    assert hatched == [[j > i for j in range(T)] for i in range(T)]
    # a second turn: the formula view follows the conversation (issue 55 item 4: it stayed on
    # the first), over the attention view's new tokens
    browser.find_element(By.ID, "message").send_keys(MESSAGES[1]["content"])
    dom = browser.execute_script
    dom("$('formula').dataset.state = ''; $('chat_status').dataset.state = ''")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda b: status.get_attribute("data-state") in ("done", "failed"))
    wait.until(lambda b: b.find_element(By.ID, "formula").get_attribute("data-state") == "ready")
    longer = dom("return view.ids")
    assert len(longer) > len(ids) and dom("return formula.ids") == longer


def test_a_long_conversation_in_the_page_leaves_out_its_oldest_turns_and_says_so(
    serve_in_process, browser, tmp_path: Path
):
    """Six turns with the chat panel's own max tokens and temperature: once the conversation
    is over max_prompt_tokens (128 here), the oldest turns are left out (the system message
    kept), greyed, and the status says so; every reply is the server's for what was sent."""
    url = serve_url(serve_in_process, save_chat_model(tmp_path / "run"))
    wait = WebDriverWait(browser, 120)
    browser.get(url)
    wait.until(lambda b: b.find_element(By.ID, "chat").is_displayed())
    cap = browser.find_element(By.ID, "cap").text  # one consistent statement of the limits
    assert "a conversation's last 128" in cap and "may have 128 tokens (max_prompt_tokens)" in cap
    for key, value in (("chat_max_tokens", "12"), ("chat_temperature", "0")):
        browser.find_element(By.ID, key).clear()
        browser.find_element(By.ID, key).send_keys(value)
    browser.find_element(By.ID, "system").send_keys(MESSAGES[0]["content"])
    status = browser.find_element(By.ID, "chat_status")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    for n in range(6):
        browser.find_element(By.ID, "message").send_keys(f"Good morrow, my lord, turn {n}.")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda b: status.get_attribute("data-state") in ("done", "failed"))
        assert status.text.startswith("done: 12 tokens, finish_reason length"), status.text
        sent = browser.execute_script("return kept().slice(0, -1)")  # what the reply answered
        answer = client.chat.completions.create(
            model="chat", messages=sent, temperature=0, max_tokens=12
        )
        reply = browser.find_elements(By.CSS_SELECTOR, "#conversation p.assistant")[-1].text
        assert reply == "assistant" + answer.choices[0].message.content
        browser.execute_script("arguments[0].dataset.state = ''", status)
    dropped = int(status.get_attribute("data-dropped"))
    assert dropped > 0 and f"the oldest {dropped} turns (greyed) were left out" in status.text
    turns = browser.find_elements(By.CSS_SELECTOR, "#conversation p")
    assert [p.get_attribute("class") for p in turns[: 1 + dropped]] == ["system"] + [
        f"{p.get_attribute('class').split()[0]} dropped" for p in turns[1 : 1 + dropped]
    ]
    assert sent[0]["role"] == "system"  # kept, whatever was left out
    browser.save_screenshot(str(tmp_path / "chat.png"))


@pytest.mark.parametrize("T", [1, 12, 128])
def test_the_formula_view_draws_every_step_with_labels_and_the_apis_numbers(
    serve_in_process, browser, tmp_path: Path, T: int
):
    """Issue 55 item 7: at 1, 12 and 128 tokens every step from X to the output through W_O is
    drawn, in rows that fit the page (no sideways scroll), with token labels on the axes (thinned
    where rows are thin, the chosen row's always there); the chosen row's S is drawn in the
    colours of the API's numbers, and its table's numbers agree with each other and with the
    API's to the digits shown."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, block_size=128, n_layer=1, n_head=2, n_embd=16))
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints" / "best", model, {"data": {"tokenizer": "bytes"}}, {})
    url = serve_url(serve_in_process, run)
    wait = WebDriverWait(browser, 120)
    dom = browser.execute_script
    browser.get(url)
    wait.until(lambda b: "layers" in b.find_element(By.ID, "model").text)
    text = ("To be, or not to be, that is the question: " * 4)[:T]
    dom("$('prompt').value = arguments[0]", text)
    browser.find_element(By.ID, "show").click()
    wait.until(lambda b: b.find_element(By.ID, "attention").get_attribute("data-state") == "ready")
    browser.find_element(By.ID, "formula_show").click()
    wait.until(lambda b: b.find_element(By.ID, "formula").get_attribute("data-state") == "ready")
    ids = dom("return view.ids")
    assert len(ids) == T
    assert dom(f"{CANVASES}.map(c => c.dataset.step)") == FLOW
    assert dom("const s = $('steps'); return s.scrollWidth <= s.clientWidth")
    for rows in dom(f"{CANVASES}.map(c => c.dataset.rows)"):
        shown = json.loads(rows)
        assert shown[0] == 0 and T - 1 in shown and len(shown) >= min(T, 20)
    _, _, api = request(url, "POST", "/api/formula", {"ids": ids, "layer": 0, "head": 0})
    S, i = api["steps"]["S"], T - 1
    visible = [S[a][b] for a in range(T) for b in range(a + 1)]
    low, high = min(visible), max(visible)
    rgb = "return colour(arguments[0]).match(/[0-9]+/g).map(Number)"  # the page's colour scale
    for j in range(T):  # the chosen (last) row has no masked cell
        assert dom(PIXEL, "S", i, j) == dom(rgb, (S[i][j] - low) / ((high - low) or 1)), j
    table = dom(
        "return [...document.querySelectorAll('#row_table tr')]"
        ".map(r => [...r.children].map(c => c.textContent))"
    )
    total = float(table[0][5].rsplit("/ ", 1)[1])
    assert total == pytest.approx(api["row"]["sum"], rel=1e-3)
    assert len(table) == T + 1
    for j, (key, _, dot, scaled, exp, weight) in enumerate(table[1:]):
        assert int(key) == j
        assert float(scaled) == pytest.approx(float(dot) / api["d_k"] ** 0.5, rel=2e-3, abs=1e-6)
        assert float(weight) == pytest.approx(float(exp) / total, rel=2e-3)
        assert float(weight) == pytest.approx(api["row"]["weights"][j], rel=1e-3)
    assert sum(float(row[5]) for row in table[1:]) == pytest.approx(1, abs=T * 5e-4)
    sqrt_dk = browser.find_element(By.ID, "sqrt_dk").text
    assert ("one token has one score" in sqrt_dk) == (T == 1)
    browser.set_window_size(1200, dom("return document.body.scrollHeight") + 100)  # all of it
    browser.find_element(By.ID, "formula").screenshot(str(tmp_path / f"formula_{T}.png"))
