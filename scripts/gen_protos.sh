#!/usr/bin/env bash
# Regenerate the gRPC stubs from protos/dlite/v1/dlite.proto into dlite_ray/serve/proto/.
# The stubs are committed (no build step at install, same code everywhere); a test checks
# they match the .proto.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dlite_ray/serve/proto}
mkdir -p "$out"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -Iprotos/dlite/v1 --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/dlite/v1/dlite.proto
sed -i 's/^import dlite_pb2 as/from . import dlite_pb2 as/' "$out/dlite_pb2_grpc.py"
# messages must pickle under their real module path (Ray ships requests between processes)
sed -i "s/'dlite_pb2', _globals/'dlite_ray.serve.proto.dlite_pb2', _globals/" "$out/dlite_pb2.py"
[ -f "$out/__init__.py" ] || echo '"""Generated gRPC stubs for dlite.v1 (scripts/gen_protos.sh)."""' > "$out/__init__.py"
