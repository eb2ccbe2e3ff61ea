#!/usr/bin/env bash
# Installs the megatron-core versions that the interop tests read and write, each in its own directory
# (VENV/megatron-core-<version>): megatron-core is installed without its dependencies (it pins other torch and Python
# versions); the tests put one directory at a time on PYTHONPATH, in their own processes.
set -euo pipefail
venv="${1:-.venv}"
install() {  # version, then the modules it imports that the environment lacks
  local target="$venv/megatron-core-$1"
  [ -f "$target/megatron/core/__init__.py" ] && return
  "$venv/bin/pip" install -q --no-deps --ignore-requires-python --target "$target" "megatron-core==$1" "${@:2}"
}
install 0.19.2 psutil triton
install 0.15.3 psutil
