"""A headless Chromium driven over the Chrome DevTools Protocol, for the browser tests.

No browser download and no Selenium/Playwright: the browser is Debian's ``chromium`` package (``make
test`` installs it when it is missing and apt-get is usable), started with ``--remote-debugging-port=0``
and a throwaway profile; the port it picked is read from ``DevToolsActivePort`` in the profile, and
one page is driven over its DevTools websocket (the ``websockets`` package's synchronous client).

    with Chromium.launch(profile_dir) as browser:
        page = browser.page
        page.navigate("http://127.0.0.1:8000/")
        page.wait_for("document.body.dataset.ready === 'yes'")
        page.evaluate("document.title")
        page.screenshot(path)

Events the browser sends between commands (console messages, JavaScript exceptions, network requests)
are kept in ``page.events``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = ("install Debian's chromium package (`sudo apt-get install -y chromium`; `make test` does this "
                "itself when run as root or with passwordless sudo), or point $EFFTX_CHROMIUM at a Chromium binary")


def find_chromium() -> str | None:
    """$EFFTX_CHROMIUM, else the first of NAMES on PATH."""
    if os.environ.get("EFFTX_CHROMIUM"):
        return shutil.which(os.environ["EFFTX_CHROMIUM"])
    return next((path for path in map(shutil.which, NAMES) if path), None)


def missing_requirements() -> str | None:
    """Why the browser tests cannot run here (None when they can)."""
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        return "the Python package `websockets` is missing: run `make setup` (it is in the dev extra)"
    if find_chromium() is None:
        where = f"$EFFTX_CHROMIUM={os.environ['EFFTX_CHROMIUM']!r} is not an executable" \
            if os.environ.get("EFFTX_CHROMIUM") else f"none of {', '.join(NAMES)} is on PATH"
        return f"no Chromium browser: {where}; {INSTALL_HINT}"
    return None


class DevToolsError(RuntimeError):
    pass


class Page:
    """One tab: CDP commands (``send``), JavaScript (``evaluate``, ``wait_for``), screenshots."""

    def __init__(self, ws_url: str):
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=None, open_timeout=30)
        self.events: list[dict] = []  # {"method": ..., "params": ...} in arrival order
        self._id = 0

    def send(self, method: str, timeout: float = 60, **params) -> dict:
        """Run a DevTools command and return its result; events arriving meanwhile go to ``events``."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise DevToolsError(f"{method}: {msg['error'].get('message')}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited if it is a promise), as JSON data."""
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            details = res["exceptionDetails"]
            raise DevToolsError(f"{expression!r} threw: {details.get('exception', {}).get('description') or details}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120, poll: float = 0.1) -> Any:
        """Poll until the expression is truthy; return its value. On timeout, say what it last was."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"after {timeout} s, {expression!r} is still {value!r}")
            time.sleep(poll)

    def navigate(self, url: str, ready: str | None = None, timeout: float = 60) -> None:
        """Open ``url`` and wait for the load (and for the ``ready`` expression, when given)."""
        res = self.send("Page.navigate", url=url)
        if res.get("errorText"):
            raise DevToolsError(f"cannot open {url}: {res['errorText']}")
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout)
        if ready:
            self.wait_for(ready, timeout)

    def screenshot(self, path: Path) -> Path:
        """The whole page (beyond the window) as a PNG file."""
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def events_named(self, method: str) -> list[dict]:
        self.evaluate("0")  # a round trip: events sent before it are in self.events now
        return [e["params"] for e in self.events if e["method"] == method]

    def wait_for_event(self, method: str, count: int = 1, timeout: float = 60) -> list[dict]:
        """Wait until ``count`` events named ``method`` have arrived; return them all."""
        deadline = time.monotonic() + timeout
        while len(found := self.events_named(method)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"after {timeout} s, {len(found)} of {count} {method} events")
            time.sleep(0.05)
        return found


class Chromium:
    """A headless Chromium process with one page attached (``page``)."""

    ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--window-size=1280,900",
            "--remote-debugging-port=0")

    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30))
        page = next(t for t in targets if t["type"] == "page")
        self.page = Page(page["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Network"):  # events: load, console/exceptions, requests
            self.page.send(f"{domain}.enable")

    @classmethod
    def launch(cls, profile_dir: Path, timeout: float = 60) -> "Chromium":
        binary = find_chromium()
        if binary is None:
            raise FileNotFoundError(missing_requirements())
        profile_dir.mkdir(parents=True, exist_ok=True)
        log = profile_dir.parent / f"{profile_dir.name}.log"
        port_file = profile_dir / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen([binary, *cls.ARGS, f"--user-data-dir={profile_dir}", "about:blank"],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{binary} did not open its DevTools port (exit code {proc.poll()}); log:\n{tail}")
            time.sleep(0.1)
        return cls(proc, int(port_file.read_text().split()[0]), log)

    def close(self) -> None:
        try:
            self.page.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
