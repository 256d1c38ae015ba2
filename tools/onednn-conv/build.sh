#!/usr/bin/env bash
# Builds libconv.so beside this script: needs g++ and oneDNN's headers (Debian: apt-get install libdnnl-dev).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-../../.venv/bin/python}
g++ -O2 -shared -fPIC -std=c++17 -I"$($PY -c 'import jax.ffi; print(jax.ffi.include_dir())')" conv.cc -ldnnl -o libconv.so
echo "built $(pwd)/libconv.so"
