"""Put Qwen3-8B and its DLite draft under /models, once, for deployments/qwen3-8b-h800.yaml.

    python cluster/fetch_models.py [--models-dir /models]

Run by the H800 workers' init container (cluster/rayservice-h800.yaml) and by the launcher's
worker initialization (cluster/h800-cluster.yaml), in the serving image. Weights that are
already complete on disk (a pre-filled volume) are left alone, without asking the Hub; else
the two repositories are downloaded, one pod at a time (a lock file on the shared volume).
HF_TOKEN is read from the environment when set (both repositories are public).

Where the Hugging Face Hub is out of reach: `--endpoint URL` (or HF_ENDPOINT) downloads from a
mirror of the Hub (e.g. https://hf-mirror.com), and `--source modelscope` (or MODEL_SOURCE)
from ModelScope (`pip install modelscope`; its repositories' default revision is "master").

Environment: TARGET_REPO (Qwen/Qwen3-8B), TARGET_REVISION (main), DRAFT_REPO
(SJTU-DAI-Sys/Qwen3-8B-DLite), DRAFT_REVISION (main), MODEL_SOURCE (huggingface),
HF_ENDPOINT. Pin the revisions to commit hashes for reproducible pods; on ModelScope, point
DRAFT_REPO at wherever the draft is mirrored there.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import sys
from dataclasses import dataclass
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


SOURCES = ("huggingface", "modelscope")
DEFAULT_REVISION = {"huggingface": "main", "modelscope": "master"}


@dataclass(frozen=True)
class Source:
    """Where the weights come from: the Hugging Face Hub (at `endpoint`, a mirror, when set)
    or ModelScope."""

    name: str = "huggingface"
    endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.name not in SOURCES:
            raise ValueError(f"unknown source {self.name!r}; choose from {', '.join(SOURCES)}")
        if self.endpoint and self.name != "huggingface":
            raise ValueError("--endpoint is a mirror of the Hugging Face Hub; ModelScope takes none")


def snapshot_download(repo_id: str, revision: str, local_dir: Path, source: Source) -> None:
    if source.name == "modelscope":
        try:
            from modelscope import snapshot_download as from_modelscope
        except ImportError as exc:
            raise RuntimeError("--source modelscope needs the modelscope package: pip install modelscope") from exc
        from_modelscope(repo_id, revision=revision, local_dir=str(local_dir))
        return
    from huggingface_hub import snapshot_download as download  # in the image through transformers

    # passed, not left to HF_ENDPOINT alone: huggingface_hub reads that once, at import
    download(repo_id=repo_id, revision=revision, local_dir=str(local_dir), endpoint=source.endpoint)


def fetch(models_dir: Path, source: Source = Source()) -> None:
    """Download whatever is missing; raise if the result is still incomplete."""
    if not missing(models_dir):
        log.info("weights complete in %s; nothing to download", models_dir)
        return
    models_dir.mkdir(parents=True, exist_ok=True)
    revision = DEFAULT_REVISION[source.name]
    with open(models_dir / ".fetch-models.lock", "w") as lock:
        # One downloader per volume: a worker that waited here finds the files complete.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target_missing(models_dir / TARGET_DIR):
            snapshot_download(os.environ.get("TARGET_REPO", DEFAULT_TARGET_REPO),
                              os.environ.get("TARGET_REVISION", revision), models_dir / TARGET_DIR, source)
        if draft_missing(models_dir / DRAFT_DIR):
            snapshot_download(os.environ.get("DRAFT_REPO", DEFAULT_DRAFT_REPO),
                              os.environ.get("DRAFT_REVISION", revision), models_dir / DRAFT_DIR, source)
    still = missing(models_dir)
    if still:
        raise RuntimeError(f"still incomplete after download: {', '.join(still)}")
    log.info("weights complete in %s", models_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path(os.environ.get("MODELS_DIR", "/models")))
    parser.add_argument("--source", choices=SOURCES, default=os.environ.get("MODEL_SOURCE", "huggingface"),
                        help="where to download from (env MODEL_SOURCE)")
    parser.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT") or None,
                        help="a mirror of the Hugging Face Hub, e.g. https://hf-mirror.com (env HF_ENDPOINT)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        fetch(args.models_dir, Source(args.source, args.endpoint))
    except (OSError, RuntimeError, ValueError) as exc:  # the Hub's errors derive from these
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
