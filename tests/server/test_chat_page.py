"""The chat page of `pyklei serve` in a real headless browser (Debian's chromium and
chromium-driver, driven by selenium): type a question, watch the reply stream in, read the
metrics (time to first token, decode tok/s, cost per million tokens at the page's price).
scripts/test.sh installs chromium when it is missing; elsewhere the test skips, saying why."""
import shutil

import pytest

webdriver = pytest.importorskip("selenium.webdriver")
from live_server import LiveServer  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver; "
           "scripts/test.sh installs them)")


@pytest.fixture(scope="module")
def browser():
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


def test_a_question_gets_a_streamed_answer_and_metrics(smollm2_q4, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with LiveServer(smollm2_q4, "--parallel", "2", "--model-id", "smollm2") as srv:
        browser.get(srv.url + "/")
        wait = WebDriverWait(browser, 120, poll_frequency=0.02)
        wait.until(lambda d: d.find_element(By.ID, "model").text == "smollm2")
        price = browser.find_element(By.ID, "price")
        price.clear()
        price.send_keys("0.36")                 # $/hour: the cost line must follow it
        browser.find_element(By.ID, "temperature").clear()
        browser.find_element(By.ID, "temperature").send_keys("0")
        box = browser.find_element(By.ID, "prompt")
        box.send_keys("What is the capital of France?")
        browser.find_element(By.ID, "send").click()

        # streamed: the reply is shown piece by piece while it is written, then finished
        reply = wait.until(lambda d: (d.find_elements(By.CSS_SELECTOR, ".assistant.streaming")
                                      or [None])[0])
        wait.until(lambda d: "done" in reply.get_attribute("class"))
        assert "Paris" in reply.text
        assert int(reply.get_attribute("data-pieces")) > 3, "the reply did not stream"
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
