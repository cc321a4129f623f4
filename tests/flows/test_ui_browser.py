"""What a user sees in the Prefect UI after an RL run, checked in a real headless Chromium.

A real ``prefect server start`` on 127.0.0.1 (its own PREFECT_HOME, started and stopped here), a
tiny RL run of 2 iterations through the CLI (``k3rl run``, with the environment of
docs/environments.md loaded from a directory outside the package), then Chromium, driven over the
DevTools protocol (a websocket on 127.0.0.1), opens the UI's pages (routes of the UI bundle shipped
in prefect/server/ui-v2, the default UI) and waits for the single-page app to render them:

- the ``rl_run`` flow run lists its subflow runs (``prepare``, ``rl_iteration`` x 2) and artifacts;
- each ``rl_iteration`` run lists its stage task runs, named by stage and iteration
  (``rollout-iter1``, ``train_step-iter1``, ...; the saves written behind the next iteration are
  ``rl_run``'s task runs); ``prepare`` lists fetch/validate/warm-up/quantize;
- the ``rl-metrics`` page shows the table, with the values of the run's ``metrics.json``;
- the ``rl-lineage`` page shows the lineage table, with the hash of the latest checkpoint's manifest;
- the ``rl-curves`` page shows the reward/KL PNG: the ``<img>`` has decoded (``naturalWidth`` equals
  the PNG's width), which fails if the UI's markdown sanitizer drops the image source;
- the ``rl-checkpoints`` page names the latest checkpoint.

Screenshots of each page are written under the test's tmp directory (``screenshots/``; the path
is printed) and, when ``K3RL_UI_SCREENSHOTS`` names a directory, copied there. ``k3rl status --json``
is checked against the same run's artifacts.

Needs a Chromium binary (``chromium`` on PATH or ``K3RL_CHROMIUM``): skipped without one, except in
CI (``CI`` set), where .ci/run installs it and a missing browser fails the test.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from flows import reports
from flows.deploy import PROJECT_ROOT
from k3core.artifacts import sha256_file

HERE = Path(__file__).resolve().parent
ITERATIONS = 2
RUN_ID = "ui"
WAIT = 90  # seconds for one page to render on a shared 2-core machine


def _chromium() -> str | None:
    return os.environ.get("K3RL_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _server_helpers():
    """_free_port, _wait_healthy and _stop of the deployment test (one copy of that logic)."""
    spec = importlib.util.spec_from_file_location("_k3rl_test_deployments_helpers", HERE / "test_deployments.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env_module_source() -> str:
    """The environment module of docs/environments.md (the block after its test marker)."""
    doc = (PROJECT_ROOT / "docs" / "environments.md").read_text()
    m = re.search(r"<!-- k3rl-test: uppercase_env.py -->\s*```python\n(.*?)```", doc, re.S)
    assert m, "docs/environments.md lost its tested example"
    return m.group(1)


# ----------------------------------------------------------------------------------------- Chromium
class Chromium:
    """Headless Chromium with a fresh profile, driven over the DevTools protocol (CDP): one page,
    commands answered by id, events ignored."""

    def __init__(self, binary: str, log: Path, size=(1400, 1000)):
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="k3rl-chromium-")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={self.profile}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--window-size={size[0]},{size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)
        port_file = Path(self.profile) / "DevToolsActivePort"  # Chromium writes its port here
        end = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()}): {log.read_text()[-2000:]}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, url: str) -> None:
        """Load ``url`` as a new document and wait until it has replaced the old one (so no check
        below can be answered by the previous page)."""
        self.eval("window.__k3rl_previous_page = true")
        self.call("Page.navigate", url=url)
        self.wait_for("!window.__k3rl_previous_page && document.readyState === 'complete'", f"loading {url}")

    def wait_for(self, expression: str, what: str, timeout: float = WAIT):
        """Poll a JS expression until it is truthy (the SPA renders after its API calls return)."""
        end = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except RuntimeError:
                value = None  # the page is between documents
            if value:
                return value
            if time.monotonic() > end:
                text = self.eval("document.body ? document.body.innerText : ''") or ""
                raise AssertionError(f"{what}: not shown after {timeout} s; page text:\n{text[:3000]}")
            time.sleep(0.5)

    def wait_text(self, needles: list[str], what: str) -> str:
        cond = " && ".join(f"t.includes({json.dumps(n)})" for n in needles)
        js = "(() => { const t = document.body ? document.body.innerText : ''; return " + cond + " ? t : null })()"
        return self.wait_for(js, what)

    def screenshot(self, path: Path, settle: float = 1.0) -> None:
        """The viewport as PNG, after ``settle`` seconds and two painted frames (lazy parts of a
        page, such as the markdown renderer, swap in after the text is already there)."""
        time.sleep(settle)
        self.eval("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=15)
            shutil.rmtree(self.profile, ignore_errors=True)


# ----------------------------------------------------------------------------------------- the API
def _api(api: str, path: str, body: dict | None = None):
    req = urllib.request.Request(f"{api}{path}", method="POST" if body is not None else "GET",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def _runs_of(api: str, flow_name: str) -> list[dict]:
    return _api(api, "/flow_runs/filter", {"flows": {"name": {"any_": [flow_name]}}, "sort": "START_TIME_ASC"})


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# ----------------------------------------------------------------------------------------- the test
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prefect_ui_shows_run_stages_artifacts_and_lineage(tmp_path):
    binary = _chromium()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("no Chromium binary in CI: .ci/run installs Debian's `chromium`")
        pytest.skip("no Chromium binary (apt-get install chromium, or set K3RL_CHROMIUM)")
    h = _server_helpers()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    envs = tmp_path / "my-envs"  # outside the package: found through PYTHONPATH only
    envs.mkdir()
    (envs / "uppercase_env.py").write_text(_env_module_source())
    artifacts = tmp_path / "artifacts"
    port = h._free_port()
    base = f"http://127.0.0.1:{port}"
    api = f"{base}/api"
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_UI_ENABLED="true",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(envs)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    server = browser = None
    t0 = time.monotonic()
    try:
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, cwd=tmp_path, start_new_session=True,
                                  stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT)
        h._wait_healthy(api, server, timeout=300)
        print(f"server healthy: {time.monotonic() - t0:.0f} s")

        run = subprocess.run(
            [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--source", "init:tiny:0",
             "--env", "uppercase_env:make_env", "--iterations", str(ITERATIONS), "--run-id", RUN_ID,
             "--artifacts", str(artifacts), "--prompts-per-iteration", "4", "--samples-per-prompt", "4",
             "--max-new-tokens", "4", "--warmup-steps", "2", "--warmup-batch", "8", "--eval-prompts", "8",
             "--eval-every", "1", "--json"],
            env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=400)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        summary = json.loads(run.stdout[run.stdout.index("{\n"):])
        assert summary["iterations"] == ITERATIONS
        print(f"RL run done: {time.monotonic() - t0:.0f} s")
        run_dir = artifacts / "runs" / RUN_ID
        _check_status_cli(env, artifacts, run_dir)

        (top,) = _runs_of(api, "rl_run")
        iters = _runs_of(api, "rl_iteration")
        (prep,) = _runs_of(api, "prepare")
        assert len(iters) == ITERATIONS and top["state_type"] == "COMPLETED"

        browser = Chromium(binary, tmp_path / "chromium.log")
        ui = f"{base}/v2"  # the default UI (prefect/server/ui-v2); routes from its router

        # the run: graph of subflows on top, subflow runs tab
        browser.open(f"{ui}/runs/flow-run/{top['id']}?tab=SubflowRuns")
        browser.wait_text([top["name"], "rl_iteration", "prepare", iters[0]["name"], iters[1]["name"]],
                          "rl_run page with its subflow runs")
        browser.screenshot(shots / "01-rl_run-graph-and-subflows.png")

        # the saves written behind the next iteration are the run's own task runs
        browser.open(f"{ui}/runs/flow-run/{top['id']}?tab=TaskRuns")
        browser.wait_text([f"save_checkpoint-iter{n}" for n in range(ITERATIONS - 1)], "rl_run's task runs")

        # each iteration: its stage task runs, named by stage and iteration (the last one's save too:
        # no later iteration hides it)
        for n, it in enumerate(iters):
            browser.open(f"{ui}/runs/flow-run/{it['id']}?tab=TaskRuns")
            saves = [f"save_checkpoint-iter{n}"] if n == ITERATIONS - 1 else []
            browser.wait_text([f"{stage}-iter{n}" for stage in
                               ("evaluate", "rollout", "score_rewards", "train_step", "transfer_weights")] + saves,
                              f"task runs of iteration {n}")
            browser.screenshot(shots / f"02-rl_iteration-{n}-task-runs.png")
        browser.open(f"{ui}/runs/flow-run/{prep['id']}?tab=TaskRuns")
        browser.wait_text(["fetch_checkpoint", "validate_checkpoint", "warmup", "quantize_mxfp4"], "prepare's task runs")
        browser.screenshot(shots / "03-prepare-task-runs.png")

        # the run's artifacts tab
        browser.open(f"{ui}/runs/flow-run/{top['id']}?tab=Artifacts")
        keys = {k: reports.artifact_key(k, RUN_ID) for k in ("metrics", "lineage", "curves", "checkpoints", "progress")}
        browser.wait_text([keys[k] for k in ("metrics", "lineage", "curves", "checkpoints")], "the run's artifacts")
        browser.screenshot(shots / "04-rl_run-artifacts.png")

        history = json.loads((run_dir / "metrics.json").read_text())
        # the latest version of each key (not GET /artifacts/{key}/latest: its id is the key's collection)
        latest = {f"rl-{k}": _api(api, "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}},
                                                              "sort": "CREATED_DESC", "limit": 1})[0]
                  for k, key in keys.items()}
        assert all(a["flow_run_id"] == top["id"] for a in latest.values()), latest
        assert latest["rl-progress"]["data"] == 100.0

        # rl-metrics: a table with one row per iteration, the values of metrics.json
        browser.open(f"{ui}/artifacts/artifact/{latest['rl-metrics']['id']}")
        cells = browser.wait_for(
            "(() => { const t = document.querySelector('table'); if (!t) return null;"
            " const rows = [...t.querySelectorAll('tr')].map(r => [...r.querySelectorAll('th,td')].map(c => c.innerText.trim()));"
            " return rows.length > 1 && rows[0].includes('reward_mean') ? rows : null })()", "the rl-metrics table")
        header, body = cells[0], [r for r in cells[1:] if any(r)]
        assert len(body) == ITERATIONS
        for row, h_ in zip(body, history):
            got = dict(zip(header, row))
            assert int(got["iteration"]) == h_["iteration"]
            for col in ("reward_mean", "heldout_reward"):
                assert got[col] == str(reports.table_number(h_[col])), col
        assert any(h_["reward_std"] > 0 for h_ in history), "the environment gave no reward signal"
        browser.screenshot(shots / "05-rl-metrics.png")

        # rl-lineage: the table, down to the latest checkpoint's manifest hash and producing task run
        manifest_sha = sha256_file(run_dir / "checkpoints" / f"iter-{ITERATIONS:04d}" / "manifest.json")[:12]
        browser.open(f"{ui}/artifacts/artifact/{latest['rl-lineage']['id']}")
        browser.wait_for("document.querySelectorAll('table tr').length > 5", "the rl-lineage table")
        browser.wait_text([f"checkpoints/iter-{ITERATIONS:04d}", manifest_sha,
                           f"save_checkpoint-iter{ITERATIONS - 1}", f"rollout-iter{ITERATIONS - 1}",
                           "source checkpoint", "init:tiny:0"], "the lineage rows")
        browser.screenshot(shots / "06-rl-lineage.png")

        # follow the chain back from the latest checkpoint, link by link: each row's producer and each
        # input link to a task run, whose page names that task run
        links = browser.eval("Object.fromEntries([...document.querySelectorAll('table a')]"
                             ".map(a => [a.textContent.trim(), a.href]))")
        last = ITERATIONS - 1
        chain = [f"save_checkpoint-iter{last}", f"train_step-iter{last}", f"score_rewards-iter{last}",
                 f"rollout-iter{last}", f"transfer_weights-iter{last - 1}", f"train_step-iter{last - 1}"]
        for name in chain:
            assert name in links and "/runs/task-run/" in links[name], (name, links)
            browser.open(links[name])
            browser.wait_text([name], f"the task run page of {name}")
        # inputs link to their producers too: the rollouts of the last iteration name the engine weights
        assert f"engine://{RUN_ID}@v{last}" in links, links
        browser.screenshot(shots / "06b-lineage-chain.png")

        # rl-curves: the PNG inside the markdown really decodes in the browser
        png = (run_dir / f"curves-{ITERATIONS:04d}.png").read_bytes()
        browser.open(f"{ui}/artifacts/artifact/{latest['rl-curves']['id']}")
        width, height = browser.wait_for(
            "(() => { const i = [...document.images].find(i => i.src.startsWith('data:image/png'));"
            " return i && i.complete && i.naturalWidth > 0 ? [i.naturalWidth, i.naturalHeight] : null })()",
            "the reward/KL image")
        assert (width, height) == _png_size(png)
        browser.screenshot(shots / "07-rl-curves.png")

        # rl-checkpoints: where the latest checkpoint is
        browser.open(f"{ui}/artifacts/artifact/{latest['rl-checkpoints']['id']}")
        browser.wait_text(["latest checkpoint", f"runs/{RUN_ID}/checkpoints/iter-{ITERATIONS:04d}",
                           "validation report"], "the checkpoints note")
        # each checkpoint's *produced by* links to the task run that saved it
        links = browser.wait_for("(() => { const l = Object.fromEntries([...document.querySelectorAll('table a')]"
                                 ".map(a => [a.textContent.trim(), a.href])); return Object.keys(l).length ? l : null })()",
                                 "the checkpoints table's links")
        saved = f"save_checkpoint-iter{ITERATIONS - 1}"
        assert saved in links and "/runs/task-run/" in links[saved], links
        browser.screenshot(shots / "08-rl-checkpoints.png")

        # the versions of rl-metrics across iterations (one per publication)
        browser.open(f"{ui}/artifacts/key/{keys['metrics']}")
        browser.wait_text([keys["metrics"], top["name"]], "the rl-metrics versions")
        browser.screenshot(shots / "09-rl-metrics-versions.png")
        print(f"browser checks done: {time.monotonic() - t0:.0f} s")
    finally:
        if browser is not None:
            browser.close()
        h._stop(server, grace=15)
        print(f"screenshots: {shots}")
        if os.environ.get("K3RL_UI_SCREENSHOTS") and shots.exists():
            shutil.copytree(shots, os.environ["K3RL_UI_SCREENSHOTS"], dirs_exist_ok=True)


def _check_status_cli(env: dict, artifacts: Path, run_dir: Path) -> None:
    """``k3rl status --json`` on the real run agrees with its artifacts."""
    r = subprocess.run([sys.executable, "-m", "flows.cli", "status", "--run-id", RUN_ID, "--artifacts",
                        str(artifacts), "--json"], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    latest = json.loads((run_dir / "latest.json").read_text())
    history = json.loads((run_dir / "metrics.json").read_text())
    assert st["iterations_done"] == latest["iteration"] == ITERATIONS
    assert st["latest_checkpoint"] == latest["checkpoint"]
    ev = [h for h in history if "heldout_reward" in h]
    assert st["heldout_reward"]["first"]["value"] == ev[0]["heldout_reward"]
    assert st["train_reward"]["last"]["value"] == history[-1]["reward_mean"]
