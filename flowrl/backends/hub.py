"""Whether the Hugging Face hub can be asked, and what a hub model name looks like (no torch:
the data layer asks before loading a dataset by hub name)."""

from __future__ import annotations

import os
import re
import threading
import time

import huggingface_hub.constants as hub_constants
from huggingface_hub.utils import get_session

HUB_PROBE_TIMEOUT_S = 10.0
"""Longest wait, in seconds, for the hub to answer before a hub name counts as unreachable."""
HUB_PROBE_REUSE_S = 60.0
"""A probe's answer serves the probes of the next this-many seconds: one command checks a
hub name several times (the early check, the preflight, the tokenizer), and offline each
probe may wait the whole timeout."""

_last_probe: tuple[float, bool] | None = None

# A hub repo id: one optional "org/" then a name, of letters, digits, "-", "_" and ".".
HUB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def hub_offline() -> bool:
    """Whether offline mode is set, read now (huggingface_hub reads it once, at import)."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return True
    return bool(hub_constants.HF_HUB_OFFLINE)


def hub_reachable(timeout_s: float) -> bool:
    """Whether the hub endpoint answers one HEAD request within ``timeout_s`` seconds.

    The request runs in a daemon thread so that a slow DNS lookup (not covered by the HTTP
    timeout) cannot hold the caller past ``timeout_s`` either. An answer of the last
    ``HUB_PROBE_REUSE_S`` seconds is given again without asking.
    """
    global _last_probe
    if _last_probe is not None and time.monotonic() - _last_probe[0] < HUB_PROBE_REUSE_S:
        return _last_probe[1]
    finished = threading.Event()
    outcome: list[bool] = []

    def probe() -> None:
        try:
            # Any HTTP status means the network works; only connection failures count.
            get_session().head(hub_constants.ENDPOINT, timeout=timeout_s)
            outcome.append(True)
        except Exception:  # noqa: BLE001 - every failure here means "unreachable"
            outcome.append(False)
        finally:
            finished.set()

    threading.Thread(target=probe, name="flowrl-hub-probe", daemon=True).start()
    reachable = finished.wait(timeout_s) and outcome == [True]
    _last_probe = (time.monotonic(), reachable)
    return reachable
