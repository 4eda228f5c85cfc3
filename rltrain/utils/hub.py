"""Before anything asks the Hugging Face Hub for a model or tokenizer (model.path, model.tokenizer): a name that is
neither a local directory nor reachable fails at once with the fix, not after the hub client's retries.

Must not download anything: it reads the local cache and asks the Hub one question (is the model there?) with a
short timeout, only when the name is not a local path, not cached, or offline mode is not set.

- a local-looking path (`/`, `./`, `~`, or two slashes) that does not exist: HubModelError naming the key;
- offline mode (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) and the name not in the cache: HubModelError (how to point
  the key at a local directory, or fill the cache where there is network);
- online: one GET of `<HF_ENDPOINT>/api/models/<name>`; no answer: HubModelError (and, when the name is cached, how
  to use the cache: HF_HUB_OFFLINE=1); 401/403/404: not on the Hub, or gated (log in), HubModelError.
"""

from __future__ import annotations

import functools
import os
import re

from rltrain.utils.errors import UserError

PROBE_TIMEOUT_S = 5.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class HubModelError(UserError, FileNotFoundError):
    """A model or tokenizer name that is not here and cannot be fetched (the message says how to fix it)."""


def offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def in_cache(name: str) -> bool:
    """Whether the Hugging Face cache holds `name`'s config or tokenizer (asked before transformers is imported)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(name, f), str) for f in ("config.json", "tokenizer_config.json"))
    except Exception:  # noqa: BLE001 (not a valid repo id, or no huggingface_hub: not cached)
        return False


@functools.lru_cache(maxsize=None)
def _probe(name: str) -> str | None:
    """None when the Hub answers that `name` exists; else why not, in a few words."""
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    request = urllib.request.Request(f"{endpoint}/api/models/{name}", method="GET")
    token = os.environ.get("HF_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):  # noqa: S310 (the Hub's https endpoint)
            return None
    except urllib.error.HTTPError as err:
        if err.code in (401, 403, 404):
            return f"not found on the Hub ({endpoint}, HTTP {err.code}): check the name; a gated or private model " \
                   "needs `huggingface-cli login` (or HF_TOKEN)"
        return None  # the Hub answered: its client reports anything else itself
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return f"the Hub ({endpoint}) cannot be reached ({reason})"


def check_model_source(name: str, key: str = "model.path") -> None:
    """HubModelError unless `name` (the value of config `key`) is a local directory or file, a Hub model that can
    be fetched, or (offline) one in the local cache. Asked once per name and process."""
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        return
    local = "directory (config.json, *.safetensors and the tokenizer files)"
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or not _HUB_ID.match(name):
        raise HubModelError(f"{key}={name!r} does not exist; fix {key} (a local {local}, or a Hugging Face model "
                            "id such as Qwen/Qwen3-0.6B)")
    fetch = (f"on a machine with network: huggingface-cli download {name} --local-dir /models/{name.split('/')[-1]}"
             f", then {key}=/models/{name.split('/')[-1]}")
    if offline():
        if in_cache(name):
            return
        raise HubModelError(f"{key}={name!r} is not a local directory and not in the Hugging Face cache, and offline "
                            f"mode (HF_HUB_OFFLINE=1) forbids downloading it; point {key} at a local {local} ({fetch})")
    why = _probe(name)
    if why is None:
        return
    if in_cache(name) and "cannot be reached" in why:
        raise HubModelError(f"{key}={name!r}: {why}, and {name} is in your Hugging Face cache: rerun with "
                            "HF_HUB_OFFLINE=1 to use the cached copy")
    raise HubModelError(f"{key}={name!r} is not a local directory and {why}; point {key} at a local {local} "
                        f"({fetch}), or set HF_HUB_OFFLINE=1 with the model in the Hugging Face cache")
