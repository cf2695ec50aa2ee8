"""The operator dashboard (GET /dashboard) in a real browser: Debian's chromium driven by Playwright.

First against scripted /metrics answers (Playwright routes), where the numbers are known: bucket
increases over the sliding window give PromQL's histogram_quantile, counter rates take resets
and replicas into account, and a failing scrape shows "metrics unreachable" and is retried.
Then against the real `vlm-engine serve` on the tiny Qwen2-VL while chat requests (one image,
sent twice) run: every chart fills with data. The screenshot lands in test-artifacts/dashboard.png
(or $VLM_TEST_ARTIFACTS)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import OBSERVED_REPLICA, make_image
from tests.server_helpers import ARTIFACTS, BROWSER_ARGS, CHROMIUM, REPO, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PAGE = REPO / "vlm_engine/server/static/dashboard.html"
CHARTS = ("throughput", "ttft", "itl", "requests", "kv", "cache", "steps")

# Per chart, how many of its canvas pixels are strongly coloured: the grid, axes and text are
# grey, so only drawn series count.
COLOURED_PIXELS = """
() => Object.fromEntries([...document.querySelectorAll(".chart")].map((chart) => {
  const canvas = chart.querySelector("canvas");
  const px = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let n = 0;
  for (let i = 0; i < px.length; i += 4) {
    if (px[i + 3] > 128 && Math.max(px[i], px[i + 1], px[i + 2]) - Math.min(px[i], px[i + 1], px[i + 2]) > 80) n++;
  }
  return [chart.id.replace("chart-", ""), n];
}))
"""
# The page's state and each chart's data-points, read at once (a scrape may land in between).
STATE = """
() => ({
  scrapes: __dashboard.scrapes, failures: __dashboard.failures, series: __dashboard.series,
  points: Object.fromEntries([...document.querySelectorAll(".chart")].map(
    (chart) => [chart.id.replace("chart-", ""), Number(chart.dataset.points)])),
})
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: `make system-packages` (run by `make test`) installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
        yield browser
        browser.close()


def new_page(browser: Any) -> Any:
    """A page that records its uncaught errors (page.errors) and console errors (page.console_errors)."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.errors = []
    page.console_errors = []
    page.on("pageerror", lambda err: page.errors.append(str(err)))
    page.on("console", lambda msg: msg.type == "error" and page.console_errors.append(msg.text))
    return page


# ---- scripted scrapes ---------------------------------------------------------------------------

LE = ("0.1", "0.5", "1.0", "+Inf")


def sample(name: str, replica: str, value: float | str, **labels: str) -> str:
    text = ",".join(f'{k}="{v}"' for k, v in {**labels, "model_name": "m", "replica": replica}.items())
    return f"vlm_engine:{name}{{{text}}} {value}"


def exposition(replicas: dict[str, dict[str, Any]]) -> str:
    """A /metrics answer: per replica, TTFT cumulative bucket counts (for LE) and a few counters
    and gauges, in prometheus_client's shape (HELP/TYPE, float values, +Inf)."""
    lines = [
        "# HELP vlm_engine:time_to_first_token_seconds Request accepted to first token",
        "# TYPE vlm_engine:time_to_first_token_seconds histogram",
    ]
    for replica, m in replicas.items():
        lines += [sample("time_to_first_token_seconds_bucket", replica, c, le=le) for le, c in zip(LE, m["ttft"])]
        lines.append(sample("time_to_first_token_seconds_count", replica, float(m["ttft"][-1])))
    lines.append("# TYPE vlm_engine:generation_tokens counter")
    for name in ("generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        lines += [sample(name, replica, float(m[name])) for replica, m in replicas.items() if name in m]
    for name in ("mm_cache_queries_total", "mm_cache_hits_total", "num_requests_running", "kv_cache_usage_perc"):
        lines += [sample(name, replica, float(m[name])) for replica, m in replicas.items() if name in m]
    lines += [sample("healthy", replica, float(m["healthy"])) for replica, m in replicas.items()]
    # What a parser must survive: escapes in HELP and label values, NaN, a timestamp.
    lines += [
        "# HELP vlm_engine:odd A help text with \\\\ and \\n in it",
        "# TYPE vlm_engine:odd gauge",
        sample("odd", "a", "NaN", path='C:\\\\dir \\"x\\"\\nnext'),
        sample("odd", "b", "1.5e-3 1700000000000", path=""),
    ]
    return "\n".join(lines) + "\n"


def replica_metrics(
    ttft: tuple[int, ...], gen: float, running: float, kv: float, healthy: float = 1, **more: float
) -> dict:
    return {"ttft": ttft, "generation_tokens_total": gen, "num_requests_running": running,
            "kv_cache_usage_perc": kv, "healthy": healthy, **more}  # fmt: skip


# Scrape 0 is the window's base. 1: replica a observes 10 TTFTs (2 <= 0.1 s, 6 <= 0.5 s, 8 <= 1 s).
# 2: /metrics fails. 3: replica b observes 10 in (0.5, 1] s, its generation counter restarted
# (50 -> 10), and it reports unhealthy.
SCRAPES = [
    {"a": replica_metrics((0, 0, 0, 0), 100, 1, 0.2, prefix_cache_queries_total=1000, prefix_cache_hits_total=0),
     "b": replica_metrics((0, 0, 0, 0), 50, 2, 0.4)},
    {"a": replica_metrics((2, 6, 8, 10), 200, 3, 0.5, prefix_cache_queries_total=1100, prefix_cache_hits_total=50,
                  mm_cache_queries_total=4, mm_cache_hits_total=1),
     "b": replica_metrics((0, 0, 0, 0), 50, 2, 0.1)},
    None,
    {"a": replica_metrics((2, 6, 8, 10), 300, 0, 0.1, prefix_cache_queries_total=1100, prefix_cache_hits_total=50,
                  mm_cache_queries_total=4, mm_cache_hits_total=1),
     "b": replica_metrics((0, 0, 10, 10), 10, 0, 0.1, healthy=0)},
]  # fmt: skip


class ScriptedMetrics:
    """Answers /metrics with SCRAPES in turn (the last one repeats); at a None it answers 503
    until `recover()`."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, route: Any) -> None:
        scrape = SCRAPES[min(self.next, len(SCRAPES) - 1)]
        if scrape is None:
            route.fulfill(status=503, body="draining")
            return
        self.next += 1
        route.fulfill(status=200, content_type="text/plain; version=0.0.4", body=exposition(scrape))

    def recover(self) -> None:
        self.next += 1


def test_scripted_scrapes_give_promql_numbers_and_show_failures(browser: Any) -> None:
    page = new_page(browser)
    metrics = ScriptedMetrics()
    page.route("http://dashboard.test/metrics", metrics)
    page.route(
        "http://dashboard.test/dashboard*",
        lambda route: route.fulfill(body=PAGE.read_bytes(), content_type="text/html"),
    )
    page.goto("http://dashboard.test/dashboard?interval=0.2")

    page.wait_for_selector("#banner", state="visible")  # scrape 2 failed
    assert page.get_attribute("#health", "data-state") == "down"
    assert "metrics unreachable: HTTP 503" in (page.text_content("#banner") or "")
    assert page.text_content("#model-name") == "m" and page.text_content("#replica") == "a, b"
    page.wait_for_function("window.__dashboard.failures >= 3")  # and it keeps trying
    metrics.recover()
    page.wait_for_function("window.__dashboard.scrapes >= 4")
    assert page.is_hidden("#banner")
    assert page.text_content("#health") == "unhealthy (1 of 2 replicas up)"

    d = page.evaluate("({series: __dashboard.series, parseErrors: __dashboard.parseErrors})")
    s, t = d["series"], d["series"]["t"]
    assert d["parseErrors"] == 0
    # Window = scrapes 0..1: a's buckets alone. p50: rank 5 of 10 lies in (0.1, 0.5] holding
    # observations 3..6, so 0.1 + 0.4 * (5 - 2) / 4; p95 and p99 land in +Inf: the highest bound, 1 s.
    assert s["ttft_p50"][:2] == [None, pytest.approx(0.4)]
    assert s["ttft_p95"][1] == pytest.approx(1.0) and s["ttft_p99"][1] == pytest.approx(1.0)
    # Window = scrapes 0..3, both replicas summed: 0.1:2, 0.5:6, 1:18, +Inf:20; rank 10 -> 0.5 + 0.5 * 4/12.
    assert s["ttft_p50"][2] == pytest.approx(0.5 + 0.5 * 4 / 12)
    # Rates between consecutive scrapes: +100 (a), then +100 (a) +10 (b, restarted at 0).
    assert s["generation_tps"][0] is None
    assert s["generation_tps"][1] * (t[1] - t[0]) == pytest.approx(100)
    assert s["generation_tps"][2] * (t[2] - t[1]) == pytest.approx(110)
    # Hit rates over the window; mm counters appear only at scrape 1 and count from 0.
    assert s["prefix_hit_rate"][1] == pytest.approx(0.5) and s["mm_hit_rate"][1] == pytest.approx(0.25)
    assert s["running"][:3] == [3, 5, 0]  # summed over replicas
    assert s["kv_usage"][:3] == [pytest.approx(0.3), pytest.approx(0.3), pytest.approx(0.1)]  # averaged

    parsed = page.evaluate(
        """() => __dashboard.parseExposition([
             '# HELP x_total Help \\\\\\\\ and \\\\n', '# TYPE x_total counter',
             'x_total{a="q\\\\"uote",b="back\\\\\\\\slash",c="new\\\\nline",} 3 1700000000',
             'inf{le="+Inf"} +Inf', 'nan NaN', 'minus -Inf', 'bad{a=1} 2', 'cut{a="x} 1', 'novalue',
           ].join("\\n"))"""
    )
    assert parsed["samples"][0] == {
        "name": "x_total",
        "labels": {"a": 'q"uote', "b": "back\\slash", "c": "new\nline"},
        "value": 3,
    }
    values = [smp["value"] for smp in parsed["samples"][1:]]
    assert values[0] == float("inf") and values[1] != values[1] and values[2] == float("-inf")
    assert parsed["types"] == {"x_total": "counter"} and parsed["help"] == {"x_total": "Help \\ and \n"}
    assert parsed["errors"] == 3
    assert page.errors == []
    # Chromium logs each failed fetch itself; nothing else may reach the console.
    assert page.console_errors and all("status of 503" in e for e in page.console_errors), page.console_errors
    page.close()


# ---- the real server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(observed_server: ServerProcess) -> ServerProcess:
    return observed_server  # conftest's: shared with test_observability and test_deploy


def image_uri() -> str:
    buf = io.BytesIO()
    make_image(64, 48, seed=3).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(client: httpx.Client, content: str | list[dict[str, Any]], max_tokens: int) -> None:
    body = {"model": "tiny-vlm", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    resp = client.post("/chat/completions", json={**body, "ignore_eos": True})  # every token an ITL sample
    assert resp.status_code == 200, resp.text


def send_requests(server: ServerProcess) -> None:
    """Three concurrent text requests; one image twice, after different words (so the prefix
    cache cannot cover it and the encoder cache is asked: a hit); a repeated prompt (a prefix hit)."""
    prompts = [f"Describe request number {i} in a few words, please, with care." for i in range(3)]
    image = {"type": "image_url", "image_url": {"url": image_uri()}}
    with httpx.Client(base_url=server.base_url, timeout=60) as client, ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda prompt: chat(client, prompt, 16), prompts))
        for words in ("Look at this.", "Look again."):
            chat(client, [{"type": "text", "text": words}, image, {"type": "text", "text": "What is it?"}], 8)
        chat(client, prompts[0], 12)


def test_the_dashboard_charts_a_live_server(browser: Any, server: ServerProcess) -> None:
    page = new_page(browser)
    page.goto(server.url + "/dashboard?interval=0.5")
    page.wait_for_function("window.__dashboard.scrapes >= 2")
    send_requests(server)
    after = page.evaluate("__dashboard.scrapes")
    # Every rate and windowed quantile the requests feed has shown up, a few scrapes later.
    page.wait_for_function(
        """(after) => {
          const d = window.__dashboard, seen = (key) => d.series[key].some((v) => v > 0);
          return d.scrapes >= after + 3 && ["generation_tps", "prompt_tps", "finished_rps", "ttft_p50",
            "itl_p50", "prefix_hit_rate", "mm_hit_rate", "step_forward"].every(seen);
        }""",
        arg=after,
        timeout=20_000,
    )
    d = page.evaluate(STATE)
    assert d["failures"] == 0
    points = d["points"]
    assert set(points) == set(CHARTS) and all(n > 0 for n in points.values()), points
    assert points["requests"] == d["scrapes"]  # gauges: a point per scrape

    s = d["series"]
    for metric in ("ttft", "itl"):
        rows = [r for r in zip(s[f"{metric}_p50"], s[f"{metric}_p95"], s[f"{metric}_p99"]) if None not in r]
        assert rows and all(0 < p50 <= p95 <= p99 < 60 for p50, p95, p99 in rows), (metric, rows)
    assert all(0 <= v <= 1 for v in s["kv_usage"])

    assert page.text_content("#model-name") == "tiny-vlm"
    assert page.text_content("#replica") == OBSERVED_REPLICA
    assert page.get_attribute("#health", "data-state") == "ok"
    assert page.is_hidden("#banner")
    coloured = page.evaluate(COLOURED_PIXELS)
    assert all(n > 50 for n in coloured.values()), coloured  # every canvas has drawn series

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\ndashboard screenshot: {shot}")
    assert page.errors == [] and page.console_errors == []
    page.close()
