"""A ``model.path`` that is a Hugging Face Hub id, checked before anything downloads it.

Without a network, ``from_pretrained`` retries each file with backoff (measured here: 36 s per lookup, and
preflight plus loading make several), then fails with a message that names no recipe key. So a hub id is
looked up once, cheaply: in the local cache first (what an offline run loads from); with
``HF_HUB_OFFLINE`` set, a model not cached is refused at once; otherwise one metadata request with a short
time limit (``HfApi.model_info``: it goes through the hub client's own session, so proxies, tokens and
``HF_ENDPOINT`` apply as they will for the download, which a bare socket probe would not honour).
"""
from __future__ import annotations

from typing import Optional

import huggingface_hub.constants
from huggingface_hub import HfApi, try_to_load_from_cache
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

# Seconds the metadata request may take: a reachable hub answers in well under one.
PROBE_TIMEOUT_S = 5.0


def cached_config(repo_id: str) -> Optional[str]:
    """The cached config.json of ``repo_id`` (what an offline load reads), or None."""
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except (HFValidationError, ValueError):
        return None
    return found if isinstance(found, str) else None


def hub_model_problem(repo_id: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why ``repo_id`` cannot be loaded from here, or None (cached, or the hub answers that it exists)."""
    if cached_config(repo_id):
        return None
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return ("neither a local directory nor a model in the Hugging Face cache, and HF_HUB_OFFLINE is set, so it "
                "cannot be downloaded (download it first, e.g. `hf download " + repo_id + "`, or unset HF_HUB_OFFLINE)")
    try:
        HfApi().model_info(repo_id, timeout=timeout_s)
    except HFValidationError as e:
        return f"neither a local directory nor a valid Hugging Face Hub id ({_one_line(e)})"
    except GatedRepoError:
        return "a gated model on the Hugging Face Hub: accept its terms on its page and log in (`hf auth login`)"
    except RepositoryNotFoundError:
        return ("neither a local directory nor a model on the Hugging Face Hub (or a private one: log in with "
                "`hf auth login`)")
    except HfHubHTTPError:  # the hub answered, with another error: the download may still work
        return None
    except Exception as e:  # noqa: BLE001 - connection errors are the HTTP client's own types
        return (f"neither a local directory nor a model in the Hugging Face cache, and {huggingface_hub.constants.ENDPOINT} "
                f"did not answer within {timeout_s:g} s ({type(e).__name__}: {_one_line(e)[:120]}); connect, or "
                "download it first (with no network, HF_HUB_OFFLINE=1 makes every hub lookup fail at once)")
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
