"""Put Qwen3-8B and its DLite draft under /models, once, for deployments/qwen3-8b-h800.yaml.

    python cluster/fetch_models.py [--models-dir /models]

Run by the H800 workers' init container (cluster/rayservice-h800.yaml) and by the launcher's
worker initialization (cluster/h800-cluster.yaml), in the serving image. Weights that are
already complete on disk (a pre-filled volume) are left alone, without asking the Hub; else
the two repositories are downloaded, one pod at a time (a lock file on the shared volume).
HF_TOKEN is read from the environment when set (both repositories are public).

Environment: TARGET_REPO (Qwen/Qwen3-8B), TARGET_REVISION (main), DRAFT_REPO
(SJTU-DAI-Sys/Qwen3-8B-DLite), DRAFT_REVISION (main). Pin the revisions to commit hashes for
reproducible pods.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("fetch_models")

# The directory names deployments/qwen3-8b-h800.yaml reads (engine.target, engine.draft).
TARGET_DIR = "Qwen3-8B"
DRAFT_DIR = "Qwen3-8B-DLite"
DEFAULT_TARGET_REPO = "Qwen/Qwen3-8B"
DEFAULT_DRAFT_REPO = "SJTU-DAI-Sys/Qwen3-8B-DLite"


def target_missing(directory: Path) -> list[str]:
    """Files a Hugging Face target directory still lacks (config, tokenizer, every shard)."""
    missing = [name for name in ("config.json", "tokenizer_config.json") if not (directory / name).is_file()]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    return missing + [name for name in shards if not (directory / name).is_file()]


def draft_missing(directory: Path) -> list[str]:
    """Files a DLite draft checkpoint still lacks: config.json with a dlite_config, model.safetensors."""
    missing = [name for name in ("config.json", "model.safetensors") if not (directory / name).is_file()]
    config = directory / "config.json"
    if config.is_file() and not isinstance(json.loads(config.read_text()).get("dlite_config"), dict):
        missing.append("config.json:dlite_config")
    return missing


def missing(models_dir: Path) -> list[str]:
    return ([f"{TARGET_DIR}/{m}" for m in target_missing(models_dir / TARGET_DIR)]
            + [f"{DRAFT_DIR}/{m}" for m in draft_missing(models_dir / DRAFT_DIR)])


def snapshot_download(repo_id: str, revision: str, local_dir: Path) -> None:
    from huggingface_hub import snapshot_download as download  # in the image through transformers

    download(repo_id=repo_id, revision=revision, local_dir=str(local_dir))


def fetch(models_dir: Path) -> None:
    """Download whatever is missing; raise if the result is still incomplete."""
    if not missing(models_dir):
        log.info("weights complete in %s; nothing to download", models_dir)
        return
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".fetch-models.lock", "w") as lock:
        # One downloader per volume: a worker that waited here finds the files complete.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target_missing(models_dir / TARGET_DIR):
            snapshot_download(os.environ.get("TARGET_REPO", DEFAULT_TARGET_REPO),
                              os.environ.get("TARGET_REVISION", "main"), models_dir / TARGET_DIR)
        if draft_missing(models_dir / DRAFT_DIR):
            snapshot_download(os.environ.get("DRAFT_REPO", DEFAULT_DRAFT_REPO),
                              os.environ.get("DRAFT_REVISION", "main"), models_dir / DRAFT_DIR)
    still = missing(models_dir)
    if still:
        raise RuntimeError(f"still incomplete after download: {', '.join(still)}")
    log.info("weights complete in %s", models_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path(os.environ.get("MODELS_DIR", "/models")))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        fetch(args.models_dir)
    except (OSError, RuntimeError, ValueError) as exc:  # the Hub's errors derive from these
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
