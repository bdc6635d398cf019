"""llama.cpp as a benchmark method: what a CPU user would run instead of our runtime.

It reads the GGUF file our runtime dequantises, through the C API of llama.cpp that
`llama-cpp-python` builds from source on the machine, so its kernels use what the CPU has
(`pip install -e '.[llamacpp]'`). Two forms:

- `llama.cpp`: the weights as the file stores them. SmolLM2's file is Q4_1, a quarter of
  bf16's bytes a token: on a bandwidth-bound CPU this is the form people run;
- `llama.cpp-bf16`: the same weights converted once to bf16 by llama.cpp's own quantizer,
  the precision our runtime computes in.

Its greedy replies are compared with plain decoding on our runtime, but a difference is no
error of a lossless method: other kernels (and, for Q4_1, other weights) round differently,
so `lossless` is False and the report gives the share of identical replies instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from pathlib import Path

import numpy as np
import torch

from dlite_ray.bench.methods import Run, timed_run

log = logging.getLogger(__name__)
LLAMACPP_METHODS = ("llama.cpp", "llama.cpp-bf16")
GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR = 3, 4  # ggml.h (llama-cpp-python's own logger says 2, 3)
_log_callback = None  # llama.cpp keeps a pointer to it: the object must outlive every call


@functools.cache
def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit("the llama.cpp methods need llama-cpp-python: pip install -e '.[llamacpp]' "
                         "(it compiles llama.cpp for this CPU, a few minutes)") from e
    global _log_callback
    _log_callback = llama_cpp.llama_log_callback(_log)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    return llama_cpp


def _log(level: int, text: bytes, _user_data) -> None:
    """llama.cpp's warnings and errors to our log; its loader's info lines (one per tensor)
    and continuation lines (level CONT, which would need the previous line's level) dropped."""
    if text and level in (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR):
        log.warning("llama.cpp: %s", text.decode(errors="replace").rstrip())


def bf16_copy(gguf: Path) -> Path:
    """`gguf` converted to bf16 by llama.cpp's quantizer, once, next to it."""
    out = gguf.with_name(gguf.stem + ".bf16.gguf")
    if out.exists():
        return out
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
    params.allow_requantize = True  # the source is quantized: dequantise, then store bf16
    params.nthread = torch.get_num_threads()
    partial = out.with_suffix(".partial")
    log.info("converting %s to bf16 with llama.cpp", gguf)
    try:
        if llama_cpp.llama_model_quantize(str(gguf).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not convert {gguf} to bf16")
        partial.rename(out)
    finally:
        partial.unlink(missing_ok=True)
    return out


class LlamaCppMethod:
    """Greedy decoding with llama.cpp on the same token ids, timed token by token. It drives
    llama.cpp's C API (decode, then argmax of the last logits), so no Python sampler sits
    between tokens. Each request starts from an empty cache: its TTFT includes the whole
    prefill, its decode speed (what the report compares) does not. Model and context live
    as long as the benchmark process."""

    lossless = False
    grammar = False  # its GBNF grammars are not wired to our schemas

    def __init__(self, name: str, gguf: Path, eos_ids: tuple[int, ...], max_context: int):
        lib = self.lib = _llama_cpp()
        self.name, self.eos_ids, self.max_context = name, set(eos_ids), max_context
        model_params = lib.llama_model_default_params()
        # llama.cpp's repacked-weight buffers (AMX here) crashed decoding SmolLM2's Q4_1 file
        # in llama-cpp-python 0.3.36 on this machine; batch-1 decode reads the weights as stored
        model_params.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        ctx_params = lib.llama_context_default_params()
        ctx_params.n_ctx = ctx_params.n_batch = max_context  # a whole prompt in one decode call
        ctx_params.n_threads = ctx_params.n_threads_batch = torch.get_num_threads()
        # its best decode here: at a 3090-token context 30.0 tok/s with flash attention off,
        # 12.8 with the default (auto, which turns it on), 11.5 forced on
        ctx_params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = lib.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a {max_context}-token context for {gguf}")
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def _decode(self, ids: list[int]) -> int:
        """Feed `ids`, return the greedy next token."""
        tokens = (self.lib.llama_token * len(ids))(*ids)
        if self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(tokens, len(ids))) != 0:
            raise RuntimeError("llama.cpp failed to decode")
        logits = self.lib.llama_get_logits_ith(self.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab_size,)).argmax())

    def run(self, ids: list[int], max_new_tokens: int) -> Run:
        max_new_tokens = min(max_new_tokens, self.max_context - len(ids))  # as our engine caps a request
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), False)  # positions restart at 0
        start = time.perf_counter()
        new, times = [self._decode(ids)], [time.perf_counter()]
        while new[-1] not in self.eos_ids and len(new) < max_new_tokens:
            new.append(self._decode(new[-1:]))
            times.append(time.perf_counter())
        return timed_run(new, start, times, [1] * len(new), time.perf_counter())
