"""Whether the Hugging Face hub can be reached: light enough to ask before torch or numpy is imported."""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request

# Short: the answer decides in seconds whether a run can start, and huggingface.co answers a HEAD in < 1 s.
PROBE_TIMEOUT_S = 2.0
_TRUE = {"1", "true", "yes", "on"}


def offline_flag() -> bool:
    """Whether the environment asks the Hugging Face libraries to stay offline."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() in _TRUE for n in names)


def hub_reachable(endpoint: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the hub endpoint answers at all within `timeout` (proxies honoured, DNS hangs bounded)."""
    url = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    result: list[bool] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result.append(True)
        except urllib.error.HTTPError:  # any HTTP answer means the network path works
            result.append(True)
        except Exception:
            result.append(False)

    # A thread bounds name resolution too, which socket timeouts do not cover.
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(result and result[0])
