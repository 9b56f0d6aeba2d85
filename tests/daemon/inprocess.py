"""The node daemon in this test process, for tests that reach inside it: wedge its event loop,
give it a kubelet directory of its own, read its probes while its sources start.

The daemon's loop runs on the main thread (it installs signal handlers, which only the main
thread may) and the test's body on another; when the body returns, the daemon is stopped as
SIGTERM would stop it.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvloop

from appliance.daemon.daemon import Daemon, DaemonConfig
from appliance.gpu.nvml import Nvml

WAIT_S = 20.0  # bounds things that take well under a second; never a measurement


class NoDriver:
    """A pynvml stand-in for a node without an NVIDIA driver."""

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's name)
        raise RuntimeError("no NVIDIA driver in this test")


def free_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::", 0))
        return int(s.getsockname()[1])


def probe(port: int, path: str, *, host: str = "127.0.0.1") -> tuple[int, str]:
    """(status, body) of GET `path`; (0, why) when nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    except OSError as exc:
        return 0, str(exc)
    finally:
        conn.close()


def eventually(check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        time.sleep(0.05)
    return got


def daemon_config(tmp: Path, policy: str, **options: Any) -> DaemonConfig:
    (tmp / "policy").mkdir(exist_ok=True)
    (tmp / "policy" / "policy.yaml").write_text(policy)
    return DaemonConfig(policy_dir=tmp / "policy", socket_dir=tmp / "run", **options)


def run_with(daemon: Daemon, body: Callable[[Daemon], None]) -> int:
    """Serve `daemon` here while `body(daemon)` runs on a thread; its exit status. A failure
    of the body is raised here, after the daemon stopped."""
    failure: list[BaseException] = []

    async def main() -> int:
        served = asyncio.create_task(daemon.run())

        async def stop() -> None:
            daemon._stopping.set()

        def run_body() -> None:
            try:
                body(daemon)
            except BaseException as exc:
                failure.append(exc)
            finally:
                asyncio.run_coroutine_threadsafe(stop(), loop)

        loop = asyncio.get_running_loop()
        thread = threading.Thread(target=run_body, name="test-body")
        thread.start()
        code = await served
        await asyncio.to_thread(thread.join)
        return code

    code = uvloop.run(main())
    if failure:
        raise failure[0]
    return code


def without_nvml() -> Nvml:
    return Nvml(library=NoDriver())
