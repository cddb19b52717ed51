"""Can the Hugging Face hub be reached, and can a hub recipe get its data before any rank starts?"""

from __future__ import annotations

import os
import shlex
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from gpipe_cli.errors import DataError
from gpipe_cli.recipe.schema import Data

# Short: the answer decides in seconds whether a run can start, and huggingface.co answers a HEAD in < 1 s.
PROBE_TIMEOUT_S = 2.0
_TRUE = {"1", "true", "yes", "on"}


def offline_flag() -> bool:
    """Whether the environment asks the Hugging Face libraries to stay offline."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() in _TRUE for n in names)


def hub_problem() -> str | None:
    """Why the hub endpoint cannot be reached (None: it answered) within PROBE_TIMEOUT_S; proxies honoured."""
    url = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    silent = f"no answer from {url} within {PROBE_TIMEOUT_S:g} s"
    result: list[str | None] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
            result.append(None)
        except urllib.error.HTTPError:  # any HTTP answer means the network path works
            result.append(None)
        except Exception as e:  # refused, or a name that does not resolve, is told at once
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                result.append(silent)
            else:
                said = reason.strerror if isinstance(reason, OSError) and reason.strerror else reason
                result.append(f"{url} cannot be reached ({said})")

    # A thread bounds name resolution too, which socket timeouts do not cover.
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(PROBE_TIMEOUT_S + 0.5)
    return result[0] if result else silent


# Keys prepare-data reads; other --set values of a run do not change which data it saves.
PREPARE_KEYS = ("data.name=", "data.config=", "data.train_split=", "data.eval_split=")


def suggested_folder(data: Data) -> str:
    """Where the prepare-data hint suggests saving a hub dataset: data/<name>[-<config>]."""
    name = (data.name or "dataset").rstrip("/").split("/")[-1]
    return f"data/{name}" + (f"-{data.config}" if data.config else "")


def prepare_hint(data: Data, recipe: str | None, overrides: Sequence[str] = ()) -> str:
    """The command that saves a recipe's hub dataset locally, and the --set that then points the recipe at it."""
    folder = suggested_folder(data)
    args = ["gpipe", "prepare-data", recipe or "RECIPE"]
    for o in overrides:
        if o.startswith(PREPARE_KEYS):
            args += ["--set", o]
    args += ["--output", folder]
    point = f"--set data.source=parquet --set data.path={shlex.quote(folder)}"
    return f"run `{shlex.join(args)}` once where there is network (copy the folder here), then add {point}"


def maybe_cached(name: str) -> bool:
    """Whether a cache folder could hold dataset `name` (a cheap test; loading it is the real one)."""
    # The hub download cache and the `datasets` cache, as the Hugging Face libraries resolve them.
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = Path(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")).expanduser()
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub"
    roots = [Path(hub).expanduser(), Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets").expanduser()]
    leaf = name.rstrip("/").split("/")[-1].lower()
    return any(root.is_dir() and any(leaf in entry.name.lower() for entry in root.iterdir()) for root in roots)


# On the launching side, without torch or `datasets` in the common case (no network, nothing cached), so an
# offline machine is told within seconds, not after the ranks have started.
def check_hub_data(data: Data, recipe: str | None, overrides: Sequence[str] = ()) -> None:
    """Fail in one line, with the prepare-data hint, when a hub dataset is neither reachable nor cached."""
    if data.source != "hub" or not data.name:
        return
    if offline_flag():
        why = "offline mode is set (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)"
    elif (problem := hub_problem()) is None:
        return  # the ranks download it (or report what the hub said)
    else:
        why = problem
    if maybe_cached(data.name):
        from gpipe_cli.data.sources import load_hub

        try:
            load_hub(data.name, data.config, None, "parquet")  # offline: reads the cache only
            return
        except DataError:
            pass
    label = f"'{data.name}'" + (f" (config '{data.config}')" if data.config else "")
    raise DataError(f"cannot download dataset {label} from the Hugging Face hub: {why}, and no cached copy; "
                    f"{prepare_hint(data, recipe, overrides)}")
