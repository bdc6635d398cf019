#!/usr/bin/env bash
# One device session's proof of the GPU path: `dlite-ray gpu-check` under a time limit,
# its JSON written as docs/gpu/gpu-check-<kind>-<commit>.json (and into $OUT, where the
# device tool collects files). The check budgets 8 minutes on one GPU; the limit below
# cuts it at 9, and the JSON, rewritten after every section, still holds what it reached.
#
#   DLITE_COMMIT=$(git rev-parse HEAD) scripts/gpu_session.sh [kind]
#   kind: h100, h200, ... (default: from nvidia-smi); DLITE_COMMIT: the commit the tree is
#   at (default: git rev-parse HEAD, where the tree is a checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
             | grep -oiE 'h100|h200|h800|a100|l40s' | tr '[:upper:]' '[:lower:]' || true)}"
kind="${kind:-gpu}"
# The device machine gets a copy of the tree without .git: the caller names the commit.
export DLITE_COMMIT="${DLITE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
out="docs/gpu/gpu-check-${kind}-${DLITE_COMMIT:0:12}.json"
python="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
status=0
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 540 "$python" -m dlite_ray.cli gpu-check --out "$out" \
    || status=$?
if [ -n "${OUT:-}" ] && [ -f "$out" ]; then
    cp "$out" "$OUT/"
fi
echo "gpu-check exit $status: $out"
exit "$status"
