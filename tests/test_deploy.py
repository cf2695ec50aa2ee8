"""deploy/: the Grafana dashboard and the Prometheus config, checked against a real `vlm-engine serve`
scraped by a real Prometheus (Debian's `prometheus` package, installed by `make system-packages`)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from tests.conftest import OBSERVED_REPLICA as REPLICA
from tests.conftest import make_image
from tests.kernel_builds import setup_missing
from tests.server_helpers import REPO, ServerProcess, free_port

pytestmark = pytest.mark.timeout(300)

DASHBOARD = REPO / "deploy/grafana/vlm-engine-dashboard.json"
PROM_CONFIG = REPO / "deploy/prometheus/prometheus.yml"
N_REQUESTS = 3
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SELECTOR = 'model_name=~"$model_name", replica=~"$replica"'
# A metric reference in PromQL, with its label selector if it has one (digits too: e2e_...).
METRIC_REF = re.compile(r"(vlm_engine:[a-z0-9_]+)(\{[^}]*\})?")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def query_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def exprs(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in query_panels(dash) for t in p["targets"]]


def test_dashboard_is_valid_grafana_json() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        x, w = p["gridPos"]["x"], p["gridPos"]["w"]
        assert 0 <= x and x + w <= 24, p["title"]
    panels = query_panels(dash)
    assert len(panels) >= 15
    for p in panels:
        assert p["type"] == "timeseries" and p["datasource"] == DS, p["title"]
        assert p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS and t["expr"].strip(), p["title"]

    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in ("model_name", "replica"):
        var = variables[name]
        assert var["type"] == "query" and var["multi"] and var["includeAll"]
        # "All" must be a regex that matches everything, for the =~ selectors below.
        assert var["allValue"] == ".*"
        assert var["definition"].startswith("label_values(") and var["definition"].endswith(f", {name})")
    # The replica list follows the chosen models.
    assert '{model_name=~"$model_name"}' in variables["replica"]["definition"]


def test_dashboard_queries_use_the_variables() -> None:
    for expr in exprs(dashboard()):
        refs = METRIC_REF.findall(expr)
        assert refs, expr
        for name, selector in refs:
            # Every series is filtered by both variables, or a panel would mix in unselected replicas.
            assert selector == "{" + SELECTOR + "}", f"{name} in {expr}"
        # rate() windows follow Grafana's interval (at least 4 scrapes), never a fixed one.
        assert set(re.findall(r"\[[^\]]*\]", expr)) <= {"[$__rate_interval]"}, expr
        if "histogram_quantile" in expr:
            assert re.search(r"by \(le[,)]", expr), expr


def test_prometheus_config_is_valid() -> None:
    import yaml  # PyYAML: transformers' own dependency
    config = yaml.safe_load(PROM_CONFIG.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
    if shutil.which("promtool") is None:
        setup_missing("promtool is not installed (Debian's prometheus package has it: `make system-packages`)")
    subprocess.run(["promtool", "check", "config", str(PROM_CONFIG)], check=True, capture_output=True)


# ---- against a real server ---------------------------------------------------------------------


class Deployment(NamedTuple):
    server: ServerProcess
    prometheus_url: str | None  # None when the prometheus binary is missing
    ttft_count: float  # the server's TTFT count once this module's requests were done


@pytest.fixture(scope="module")
def deployment(observed_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """conftest's shared server after N_REQUESTS more chat requests, and a real Prometheus scraping it."""
    tmp = tmp_path_factory.mktemp("deploy")
    srv = observed_server
    with contextlib.ExitStack() as cleanup:
        url = None
        if shutil.which("prometheus"):
            # Started first: its target discovery waits ~5 s before the first scrape, while the
            # requests below run.
            url = cleanup.enter_context(prometheus(scrape_config(f"127.0.0.1:{srv.port}", tmp), tmp))
        before = ttft_count(srv)
        # One request carries an image, so the media panel's histogram has samples too.
        for i in range(N_REQUESTS):
            content: list[dict[str, Any]] = [{"type": "text", "text": f"Describe picture {i}."}]
            if i == 0:
                content.insert(0, {"type": "image_url", "image_url": {"url": png_data_uri(seed=1)}})
            body = {"model": "tiny-vlm", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
            response = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        after = ttft_count(srv)
        assert after == before + N_REQUESTS
        yield Deployment(srv, url, after)


def ttft_count(srv: ServerProcess) -> float:
    return srv.metrics()["vlm_engine:time_to_first_token_seconds_count"]


def png_data_uri(seed: int) -> str:
    buf = io.BytesIO()
    make_image(64, 48, seed=seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def exposition(srv: ServerProcess) -> tuple[dict[str, str], list[str]]:
    """/metrics as ({family: type} from the # TYPE lines, [sample lines])."""
    text = httpx.get(srv.url + "/metrics", timeout=5.0).text
    families, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = kind
        elif line and not line.startswith("#"):
            samples.append(line)
    return families, samples


def family_of(ref: str, families: dict[str, str]) -> str | None:
    """The exported family a PromQL metric name belongs to, by its suffix and the family's type: the
    # TYPE line names a histogram without _bucket/_sum/_count, and a counter with _total in the text
    format prometheus_client writes (0.0.4), without it in OpenMetrics."""
    if families.get(ref) == "gauge":
        return ref
    if ref.endswith("_total"):
        for name in (ref, ref.removesuffix("_total")):
            if families.get(name) == "counter":
                return name
    for suffix in HISTOGRAM_SUFFIXES:
        if ref.endswith(suffix) and families.get(ref.removesuffix(suffix)) == "histogram":
            return ref.removesuffix(suffix)
    return None


@pytest.mark.slow
def test_dashboard_metrics_are_exported(deployment: Deployment) -> None:
    families, samples = exposition(deployment.server)
    referenced = {name for expr in exprs(dashboard()) for name, _ in METRIC_REF.findall(expr)}
    # Labeled families (errors by status...) have a # TYPE line before their first sample, so
    # checking families, not samples, also covers what this test's traffic did not produce.
    missing = sorted(ref for ref in referenced if family_of(ref, families) is None)
    assert not missing, f"the dashboard uses metrics the server does not export: {missing}"
    engine = [s for s in samples if s.startswith("vlm_engine:")]
    assert engine
    for sample in engine:
        # The dashboard's two variables filter on these labels; a sample without them is invisible.
        assert 'model_name="tiny-vlm"' in sample and f'replica="{REPLICA}"' in sample, sample
    media = [s for s in engine if s.startswith("vlm_engine:media_preprocess_seconds_count{")]
    kinds = {re.search(r'kind="([a-z_]+)"', s).group(1) for s in media}
    assert kinds and kinds <= {"image_decode", "video_extraction", "pdf_render", "image_processor"}, kinds


def scrape_config(target: str, tmp_path: Path) -> Path:
    """deploy/prometheus/prometheus.yml, pointed at `target` and scraping every second."""
    try:
        import yaml  # Transformers depends on pyyaml, so it is normally here

        config = yaml.safe_load(PROM_CONFIG.read_text())
    except ImportError:
        config = {"global": {}, "scrape_configs": [{"job_name": "vlm-engine", "metrics_path": "/metrics"}]}
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


@contextlib.contextmanager
def prometheus(config: Path, tmp_path: Path) -> Iterator[str]:
    """A real Prometheus on a free loopback port; yields its URL once it is ready."""
    url = f"http://127.0.0.1:{free_port()}"
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        cmd = [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address={url.removeprefix('http://')}",
        ]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ready(url):
            assert proc.poll() is None, f"prometheus exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"prometheus not ready after 30 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, promql: str) -> list[dict[str, Any]]:
    body = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=5).json()
    assert body["status"] == "success", f"{promql}: {body}"
    return body["data"]["result"]


@pytest.mark.slow
def test_prometheus_scrapes_the_server(deployment: Deployment) -> None:
    url = deployment.prometheus_url
    if url is None:
        # Not a skip: CI must run this test. Debian's package brings promtool too.
        pytest.fail("prometheus is not installed: run `make system-packages` (run by `make test`)")
    # Scrapes from before the requests finished saw fewer; wait for one after them.
    deadline, total, expected = time.monotonic() + 30, None, deployment.ttft_count
    while total != expected:
        if time.monotonic() > deadline:
            targets = httpx.get(url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            pytest.fail(f"TTFT count in Prometheus is {total}, not {expected}, after 30 s; targets: {targets}")
        time.sleep(0.2)
        series = query(url, "vlm_engine:time_to_first_token_seconds_count")
        total = sum(float(s["value"][1]) for s in series) if series else None
    for s in series:
        assert s["metric"]["model_name"] == "tiny-vlm" and s["metric"]["replica"] == REPLICA
        assert s["metric"]["job"] == "vlm-engine"  # the job name from deploy/prometheus/prometheus.yml

    # Every dashboard query is valid PromQL that Prometheus evaluates, with the variables as
    # Grafana fills them in for "All".
    for expr in exprs(dashboard()):
        filled = expr.replace("$model_name", ".*").replace("$replica", ".*")
        query(url, filled.replace("$__rate_interval", "15s"))
    # The variables' label_values(selector, label) queries, asked as Grafana asks them.
    for var in dashboard()["templating"]["list"][1:]:
        selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", var["definition"]).groups()
        params = {"match[]": selector.replace("$model_name", "tiny-vlm")}
        values = httpx.get(f"{url}/api/v1/label/{label}/values", params=params, timeout=5).json()["data"]
        assert values == [{"model_name": "tiny-vlm", "replica": REPLICA}[label]], var["name"]
