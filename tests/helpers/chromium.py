"""Open a local HTML file in headless Chromium and report what a reader would see: console
errors and exceptions, every image's load state, and a full-page screenshot (DevTools
protocol over a websocket; Debian's `chromium`, installed by `make chromium`)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import websocket

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
    "--window-size=1280,1000",
]


@dataclass
class PageCheck:
    console_errors: list[str]
    images: list[dict]
    """Per <img>: complete, naturalWidth, naturalHeight, alt."""
    screenshot_png: bytes
    values: list = field(default_factory=list)
    """What each of `check_page`'s `evaluate` expressions returned, in order."""


class _Session:
    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id, self.events = 0, []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            for ev in self.events[seen:]:
                if ev.get("method") == method:
                    return ev
            seen = len(self.events)
            self.events.append(json.loads(self.ws.recv()))
        raise TimeoutError(method)


def _devtools_port(profile: str, proc: subprocess.Popen, timeout_s: float = 60) -> int:
    path = os.path.join(profile, "DevToolsActivePort")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                first = f.readline().strip()
            if first:
                return int(first)
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}")
        time.sleep(0.1)
    raise TimeoutError("chromium did not open its DevTools port")


def _evaluate(s: _Session, expression: str):
    result = s.call("Runtime.evaluate", expression=expression, returnByValue=True)
    if "exceptionDetails" in result:
        raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
    return result["result"].get("value")


def check_page(html_path: str, evaluate: tuple[str, ...] = ()) -> PageCheck:
    """Load the page at 1280 x 1000 CSS px; after the load, run each JavaScript expression of
    `evaluate` in order (its value returned by value: numbers, strings, arrays, objects), then
    take the screenshot."""
    if not os.path.exists(CHROMIUM):
        raise RuntimeError(f"{CHROMIUM} missing: run `make chromium` (apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="playbook-chromium-")
    proc = subprocess.Popen(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own temporary files (a singleton socket's folder, left behind when it is stopped)
        # go into the profile, removed below, not into /tmp.
        env={**os.environ, "TMPDIR": profile},
    )
    try:
        port = _devtools_port(profile, proc)
        import urllib.request

        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
        page = next(t for t in targets if t["type"] == "page")
        s = _Session(page["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log"):
            s.call(f"{domain}.enable")
        s.call("Page.navigate", url="file://" + os.path.abspath(html_path))
        s.wait_for("Page.loadEventFired")
        images = s.call(
            "Runtime.evaluate",
            expression="JSON.stringify(Array.from(document.images).map(i => ({complete: i.complete, "
            "naturalWidth: i.naturalWidth, naturalHeight: i.naturalHeight, alt: i.alt})))",
            returnByValue=True,
        )["result"]["value"]
        values = [_evaluate(s, expression) for expression in evaluate]
        size = s.call("Page.getLayoutMetrics")["cssContentSize"]
        shot = s.call(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        errors = []
        for ev in s.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append(str(p.get("args")))
            elif m == "Runtime.exceptionThrown":
                errors.append(str(p.get("exceptionDetails")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                errors.append(str(p["entry"].get("text")))
        s.ws.close()
        return PageCheck(errors, json.loads(images), base64.b64decode(shot["data"]), values)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)
