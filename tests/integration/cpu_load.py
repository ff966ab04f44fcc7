"""Busy loops that hold the machine's cores while a test runs (races show under load)."""
from __future__ import annotations

import subprocess
import sys


class CpuLoad:
    """A busy loop per core, each ending by itself after ``seconds``."""

    def __init__(self, seconds: float, cores: int = 2) -> None:
        code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(cores)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)
