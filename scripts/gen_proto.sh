#!/usr/bin/env bash
# Regenerates server/proto/jaxserve_pb2.py and jaxserve_pb2_grpc.py from jaxserve.proto.
# The generated files are committed, so users never need protoc; run this after editing the
# proto (needs grpcio-tools, a test dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. server/proto/jaxserve.proto
# Generated code is not ours to lint.
for f in server/proto/jaxserve_pb2.py server/proto/jaxserve_pb2.pyi server/proto/jaxserve_pb2_grpc.py; do
  printf '# ruff: noqa\n%s\n' "$(cat "$f")" > "$f"
done
echo "generated server/proto/jaxserve_pb2.py, jaxserve_pb2.pyi, jaxserve_pb2_grpc.py"
