"""Model paths given as Hugging Face Hub ids, resolved through the local Hugging Face cache: nothing is downloaded."""
from __future__ import annotations

import os
import re

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")  # org/name, optionally @revision


def is_hub_id(path) -> bool:
    """Whether `path` reads as a Hub id ("org/name[@revision]") and is no file or folder here."""
    text = os.fspath(path)
    return bool(REPO_ID.match(text)) and not os.path.exists(text)


def cache_dir() -> str:
    """The Hugging Face hub cache this process reads: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def resolve(path) -> str:
    """`path` itself, or for a Hub id the folder of its snapshot in the local cache (`huggingface_hub`, offline).

    Raises FileNotFoundError naming the id and the cache when the id is not cached (posttrain never downloads: the
    message says how to fetch it elsewhere)."""
    text = os.fspath(path)
    if not is_hub_id(text):
        return text
    from huggingface_hub import snapshot_download

    repo_id, _, revision = text.partition("@")
    try:
        return snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir(), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError and kin: the id is not in this cache
        raise FileNotFoundError(
            f"{text}: not a local path, and as a Hugging Face Hub id not in the local cache {cache_dir()} "
            f"({type(e).__name__}); posttrain reads models offline: fetch it where there is network "
            f"(`hf download {repo_id}` or `huggingface-cli download {repo_id}`) into that cache, or give a local "
            "path (a .gguf file or an HF model directory)") from None
