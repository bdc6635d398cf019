"""Generated gRPC stubs for dlite.v1 (scripts/gen_protos.sh)."""
