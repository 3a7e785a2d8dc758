"""Peak resident memory of a code region, sampled from /proc (CPU tensors do not go through tracemalloc)."""

from __future__ import annotations

import os
import resource
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; falls back to the lifetime peak elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """Context manager: sample RSS every ``interval`` seconds in a thread and keep the peak.

    After the block, ``peak_bytes`` is the highest RSS seen and ``delta_bytes`` the peak minus the RSS at entry
    (what the region added). Sampling can miss a spike shorter than ``interval``; benchmarks that need exact
    peaks run each arm in its own subprocess and read ``ru_maxrss`` instead.
    """

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.start_bytes = self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.start_bytes = self.peak_bytes = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    @property
    def delta_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes


def optimizer_state_bytes(optimizer) -> int:
    """Bytes an optimizer keeps between steps: tensor storage plus 8 bytes per Python scalar in its state."""

    def size(obj) -> int:
        if hasattr(obj, "element_size") and hasattr(obj, "nelement"):
            return obj.element_size() * obj.nelement()
        if isinstance(obj, dict):
            return sum(size(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(size(v) for v in obj)
        if isinstance(obj, (int, float, bool)):
            return 8
        return 0

    return sum(size(v) for v in optimizer.state.values())


def run_isolated(script: str, *args: str) -> dict:
    """Run ``python script *args`` in a fresh process and parse the JSON object on its last stdout line.

    Benchmarks measure each arm this way so that ``ru_maxrss`` is that arm's own peak. HF_HUB_OFFLINE is set;
    a failing worker raises SystemExit with the tail of its stderr.
    """
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
