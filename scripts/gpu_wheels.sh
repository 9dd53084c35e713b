#!/usr/bin/env bash
# The wheels scripts/gpu_run.sh needs on the GPU machine, into DIR (default .whl/, carried with the tree):
#   bash scripts/gpu_wheels.sh [DIR]
# gpu_run.sh installs them there with pip --no-index --target /tmp/site and puts /tmp/site on PYTHONPATH and
# JUPYTER_PATH. Binary wheels for CPython 3.12 on x86-64 Linux, no dependencies resolved: the list is the closure.
set -euo pipefail
dir=${1:-.whl}
list="$(cd "$(dirname "$0")" && pwd)/gpu-wheels.txt"
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$dir" -r "$list"
du -sh "$dir"
