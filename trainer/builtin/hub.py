"""A ``model.path`` or ``data.source`` that is a Hugging Face Hub id, checked before anything downloads it.

Without a network, ``from_pretrained`` retries each file with backoff (measured here: 36 s per lookup, and
preflight plus loading make several), then fails with a message that names no recipe key. So a hub id is
looked up once, cheaply: in the local cache first (what an offline run loads from); with
``HF_HUB_OFFLINE`` set, a model not cached is refused at once; otherwise one metadata request with a short
time limit (``HfApi.model_info``: it goes through the hub client's own session, so proxies, tokens and
``HF_ENDPOINT`` apply as they will for the download, which a bare socket probe would not honour).
A dataset the same way (``datasets.load_dataset`` retries 5 times with backoff, 24 s measured, then fails with
``ConnectionError``); cached means a folder for it in the hub cache or in datasets' own cache of prepared data.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

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


def cached_dataset(repo_id: str) -> bool:
    """Whether ``repo_id`` has a folder in the hub cache or in datasets' cache of prepared data (what an
    offline load reads)."""
    import datasets.config  # late: only a hub dataset source needs it

    return ((Path(huggingface_hub.constants.HF_HUB_CACHE) / f"datasets--{repo_id.replace('/', '--')}").is_dir()
            or (Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___")).is_dir())


def hub_model_problem(repo_id: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why ``repo_id`` cannot be loaded from here, or None (cached, or the hub answers that it exists)."""
    if cached_config(repo_id):
        return None
    return _hub_problem(repo_id, "model", lambda: HfApi().model_info(repo_id, timeout=timeout_s), timeout_s,
                        offline=huggingface_hub.constants.HF_HUB_OFFLINE, offline_flag="HF_HUB_OFFLINE")


def hub_dataset_problem(repo_id: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """``hub_model_problem`` for a dataset."""
    import datasets.config  # late: as cached_dataset

    if cached_dataset(repo_id):
        return None
    offline_flag = "HF_HUB_OFFLINE" if huggingface_hub.constants.HF_HUB_OFFLINE else "HF_DATASETS_OFFLINE"
    return _hub_problem(repo_id, "dataset", lambda: HfApi().dataset_info(repo_id, timeout=timeout_s), timeout_s,
                        offline=huggingface_hub.constants.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE,
                        offline_flag=offline_flag)


def _hub_problem(repo_id: str, kind: str, info: Callable[[], object], timeout_s: float, *, offline: bool,
                 offline_flag: str) -> Optional[str]:
    """Why the ``kind`` (model, dataset) ``repo_id``, not cached, cannot be downloaded; None if the hub has it."""
    get = f"hf download {repo_id}" + (" --repo-type dataset" if kind == "dataset" else "")
    local = "a local directory" if kind == "model" else "a local file or directory"
    if offline:
        return (f"neither {local} nor a {kind} in the Hugging Face cache, and {offline_flag} is set, so it "
                f"cannot be downloaded (download it first, e.g. `{get}`, or unset {offline_flag})")
    try:
        info()
    except HFValidationError as e:
        return f"neither {local} nor a valid Hugging Face Hub id ({_one_line(e)})"
    except GatedRepoError:
        return f"a gated {kind} on the Hugging Face Hub: accept its terms on its page and log in (`hf auth login`)"
    except RepositoryNotFoundError:
        return (f"neither {local} nor a {kind} on the Hugging Face Hub (or a private one: log in with "
                "`hf auth login`)")
    except HfHubHTTPError:  # the hub answered, with another error: the download may still work
        return None
    except Exception as e:  # noqa: BLE001 - connection errors are the HTTP client's own types
        return (f"neither {local} nor a {kind} in the Hugging Face cache, and {huggingface_hub.constants.ENDPOINT} "
                f"did not answer within {timeout_s:g} s ({type(e).__name__}: {_one_line(e)[:120]}); connect, or "
                "download it first (with no network, HF_HUB_OFFLINE=1 makes every hub lookup fail at once)")
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
