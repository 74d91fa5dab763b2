"""Start a ``specserve serve`` process for a sweep, wait (bounded) until it serves, and always stop it.

The server prints ``specserve: serving on http://HOST:PORT`` once ready (it binds port 0, so the port is
only known from that line); the sweep then also waits for ``/health`` to answer 200. Its output goes to a log
file, whose tail is in the error if start-up fails. The server runs in a session of its own so that stopping
it (SIGTERM, then SIGKILL after a grace period) also reaches any worker processes it started. For the same
reason a signal to the sweep's own process group does not reach it: a SIGTERM to the process that started it
exits through Python (``with`` blocks stop their servers) instead of at once, which left them running.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

READY = re.compile(r"^specserve: serving on (https?://\S+)\s*$")
LOG_TAIL_CHARS = 3000


def serve_command(engine_args: list[str], prefix: list[str] | None = None) -> list[str]:
    """``specserve serve`` with this interpreter (so the sweep's environment serves), on a free port.
    ``prefix``: another command that takes the same flags and prints the same ready line."""
    args = list(engine_args)
    if "--port" not in args:
        args += ["--port", "0"]
    if prefix is None and "--data-dir" not in args:  # its own job store: a running server may hold the default one
        args += ["--data-dir", tempfile.mkdtemp(prefix="specserve-bench-")]
    return [*(prefix or [sys.executable, "-m", "engine.cli", "serve"]), *args]


def _exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit (status 143) in this process where nothing else handles it, so ``finally`` and
    ``__exit__`` run and stop the servers it started (only the main thread can set a handler)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class ServerProcess:
    def __init__(self, cmd: list[str], log_path: str, startup_timeout_s: float = 300.0,
                 stop_timeout_s: float = 30.0, env: dict[str, str] | None = None):
        if not startup_timeout_s > 0:
            raise ValueError(f"startup timeout must be > 0, got {startup_timeout_s}")
        self.cmd, self.log_path = cmd, log_path
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        _exit_on_sigterm()
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by the reader thread)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                     text=True, bufsize=1, start_new_session=True, env=self.env)
        urls: queue.Queue[str] = queue.Queue()

        def read() -> None:  # copies stdout to the log (a full pipe would block the server) and finds the URL
            assert self.proc is not None and self.proc.stdout is not None
            try:
                for line in self.proc.stdout:
                    log.write(line)
                    log.flush()
                    m = READY.match(line)
                    if m:
                        urls.put(m.group(1))
            finally:
                log.close()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while self.url is None:
            try:
                self.url = urls.get(timeout=0.2).rstrip("/")
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with status {self.proc.returncode} before serving: "
                                       f"{' '.join(self.cmd)}\n{self.log_tail()}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the server did not print its URL within {self.startup_timeout_s:.0f} s: "
                                       f"{' '.join(self.cmd)}\n{self.log_tail()}") from None
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.url}/health did not answer 200 within {self.startup_timeout_s:.0f} s"
                                   f"\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> int | None:
        """Stops the server (idempotent); returns its exit status."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(p.pid, sig)  # the server's own session: it and the workers it started
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # the server is gone; workers it left in its session may not be
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._reader is not None:
            self._reader.join(timeout=5)
        return p.returncode

    def log_tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-LOG_TAIL_CHARS:]
        except OSError:
            return ""
