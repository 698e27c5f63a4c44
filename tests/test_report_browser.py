"""The report in a real headless Chromium: it loads with no console error and no network
request, every device of the plan has a timeline row, and a screenshot is saved.

Chromium is Debian's package (`apt-get install -y chromium`; the Makefile / CI install it).
Without it the test skips, except under CI=true, where it fails and says how to install it.
The browser is driven over the DevTools protocol with a small WebSocket client (stdlib only):
Runtime/Log events catch console errors and exceptions, Network events every request.
The harness is checked first on a page that does make a request and log an error, so a
broken harness cannot pass a broken report.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = pytest.mark.slow

SCREENSHOT_DIR_ENV = "HETEROG_SCREENSHOT_DIR"  # copy the screenshot there too (docs/img)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    msg = (
        "no chromium or chromium-browser on PATH; install Debian's package: "
        "apt-get update && apt-get install -y chromium"
    )
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


class _WebSocket:
    """The client half of RFC 6455, enough for the DevTools protocol: text frames, masked
    sends, fragmented receives, ping ignored."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout_s)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            assert chunk, "DevTools closed the connection during the handshake"
            head += chunk
        assert head.split(b"\r\n")[0].split()[1] == b"101", head

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "DevTools closed the connection"
            buf += chunk
        return buf

    def send(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        head = bytes([0x81]) + (
            bytes([0x80 | n])
            if n < 126
            else bytes([0x80 | 126]) + struct.pack(">H", n)
            if n < 65536
            else bytes([0x80 | 127]) + struct.pack(">Q", n)
        )
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            payload = self._read(n)
            op = b0 & 0x0F
            if op == 8:
                raise ConnectionError("DevTools closed the WebSocket")
            if op in (9, 10):
                continue
            parts.append(payload)
            if b0 & 0x80:
                return b"".join(parts).decode()


class _Browser:
    """One headless Chromium with one page, its console and network events recorded."""

    def __init__(self, exe: str, profile: Path):
        self.proc = subprocess.Popen(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "--window-size=1400,1000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline and self.proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = []
        while not pages:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t["type"] == "page"]
        self.ws = _WebSocket(pages[0]["webSocketDebuggerUrl"])
        self.next_id = 0
        self.events: list[dict] = []
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable")

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg["result"]
            self.events.append(msg)

    def load(self, url: str, settle_s: float = 1.0) -> None:
        """Navigate and wait for the load event, then a moment for late requests or errors."""
        self.events.clear()
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            assert time.monotonic() < deadline, "the page did not finish loading in 30 s"
            self.events.append(json.loads(self.ws.recv()))
        self.call(
            "Runtime.evaluate", expression=f"new Promise(r => setTimeout(r, {settle_s * 1000}))", awaitPromise=True
        )

    def problems(self, own_url: str) -> tuple[list[str], list[str]]:
        """(console errors and exceptions, requests for anything but the page itself)."""
        errors, requests = [], []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                errors.append(p["exceptionDetails"].get("text", "exception"))
            elif m == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                errors.append(p["entry"]["text"])
            elif m == "Network.requestWillBeSent" and p["request"]["url"] != own_url:
                requests.append(p["request"]["url"])
        return errors, requests

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"]["value"]

    def screenshot(self, path: Path) -> None:
        h = self.evaluate("document.documentElement.scrollHeight")
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=int(h), deviceScaleFactor=1, mobile=False)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = _Browser(_chromium(), tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def test_harness_sees_console_errors_and_requests(browser, tmp_path):
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><body><img src="http://198.51.100.1/x.png">'
        '<script>console.error("boom")</script></body></html>'
    )
    url = page.as_uri()
    browser.load(url, settle_s=0.2)
    errors, requests = browser.problems(url)
    assert any("boom" in e for e in errors)
    assert requests == ["http://198.51.100.1/x.png"]


def test_report_loads_clean_with_a_row_per_device(browser, tmp_path):
    from heterog.capture import capture_model
    from heterog.cost import build_cost_model
    from heterog.hardware.spec import load_cluster
    from heterog.ir.plan import ModelSpec
    from heterog.report import ReportInputs, build_report
    from heterog.report.inputs import candidate_from_dict
    from heterog.search.planner import plan_graph
    from heterog.simulate import simulate

    clu = load_cluster("paper-8gpu")
    graph = capture_model("toy-cnn", batch_size=64)
    costs = build_cost_model(graph, clu)
    result = plan_graph(
        graph,
        clu,
        costs,
        budget_s=2.0,
        seed=0,
        policy=False,
        max_iters=50,
        model_spec=ModelSpec(name="toy-cnn", batch_size=64),
    )
    doc = result.to_dict()
    plan = result.best
    sim = simulate(graph, clu, plan, costs)
    cands = tuple(candidate_from_dict(c, "test") for c in doc["candidates"])
    out = tmp_path / "report.html"
    out.write_text(build_report(ReportInputs(plan=plan, sim=sim, cluster=clu, candidates=cands)))
    url = out.as_uri()
    browser.load(url)
    errors, requests = browser.problems(url)
    assert errors == []
    assert requests == []
    rows = browser.evaluate(
        "[...document.querySelectorAll('#timeline-sim g.device-row')]"
        ".map(g => [g.dataset.device, g.getBoundingClientRect().height])"
    )
    assert [r[0] for r in rows] == [d.name for d in clu.devices]
    assert all(h > 10 for _, h in rows)  # drawn, not collapsed
    shot = tmp_path / "report.png"
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get(SCREENSHOT_DIR_ENV):
        shutil.copy(shot, Path(os.environ[SCREENSHOT_DIR_ENV]) / "report-test.png")
