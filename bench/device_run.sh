#!/usr/bin/env bash
# The mesh engine on one H200 through tinygrad (DEV=CUDA). The working tree that travels is capped at 64 MiB a call
# and SmolLM2's GGUF is 98 MB (the wheels, aiortc's av among them, another 46 MB), so the model travels in parts over
# consecutive calls to the one warm machine and is put together there:
#
#   bench/device_run.sh stash          carry .whl .model -> installs the wheels, keeps .model/part.* in /tmp/parts
#   bench/device_run.sh tests          stash, then pytest tests/test_engine_stage.py tests/test_worker.py on CUDA
#   bench/device_run.sh bench PARTS    stash, join the parts, then PARTS of engine,mesh,ptx (comma list)
#
# Here, before each call, .model/ (listed in .git/info/exclude) holds only that call's parts, cut with
#   head -c / tail -c from SmolLM2-135M-Instruct.Q4_1.gguf, named so that `ls` sorts them in file order.
# Everything printed also lands in $OUT.
set -u
phase=${1:?tests or bench}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONUNBUFFERED=1

# Wheels (tinygrad, trio, gguf, wsproto, pytest-trio...) into /tmp/site as device/README says; a .pth in the image's
# site-packages too, because bench/mesh_bench.py starts its peers with PYTHONPATH replaced by the repo root.
if [ -d .whl ] && [ ! -f /tmp/site/.mesh_installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo /tmp/site > "$sp/zz_mesh_site.pth" && touch /tmp/site/.mesh_installed
fi
export PYTHONPATH=/tmp/site

mkdir -p /tmp/parts; [ -d .model ] && cp .model/part.* /tmp/parts/; ls -l /tmp/parts
python3 -c 'import signaling, mesh.peer, engine.stage, pytest_trio' || exit 2

case $phase in
stash) ;;
tests)
  {
    date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -V; echo "nvcc: $(command -v nvcc)  clang: $(command -v clang)  CC=${CC:-}"; nproc
    DEV=CUDA python3 -c 'from tinygrad import Tensor, Device; print("tinygrad", Device.DEFAULT, (Tensor([1,2,3])*2).tolist())'
  } 2>&1 | tee "$OUT/env.txt"
  # No -x: every failure is wanted, to tell CPU-specific tests from GPU ones.
  DEV=CUDA timeout 420 python3 -m pytest -q -rfE -p no:cacheprovider --timeout 180 \
    tests/test_engine_stage.py tests/test_worker.py 2>&1 | tee "$OUT/pytest_cuda.txt"
  ;;
bench)
  cat /tmp/parts/part.* > "$MODEL"
  echo "$MODEL_SHA  $MODEL" | sha256sum -c - || exit 4
  t0=$(date +%s); parts=${2:-engine,mesh}
  if [[ $parts == *engine* ]]; then
    DEV=CUDA timeout 220 python3 bench/engine_bench.py --model "$MODEL" --tokens 64 --skip llama,memory 2>&1 \
      | tee "$OUT/engine_bench_cuda.txt"
  fi
  if [[ $parts == *mesh* ]]; then
    DEV=CUDA timeout 420 python3 bench/mesh_bench.py --model "$MODEL" --tokens 64 --peers 1,2,3 2>&1 \
      | tee "$OUT/mesh_bench_cuda.txt"
  fi
  left=$((560 - ($(date +%s) - t0)))
  if [[ $parts == *ptx* ]] && [ "$left" -gt 60 ]; then  # the renderer used where nvcc is missing
    DEV=CUDA:PTX timeout "$left" python3 bench/engine_bench.py --model "$MODEL" --tokens 64 --skip llama,memory,batch \
      2>&1 | tee "$OUT/engine_bench_ptx.txt"
  fi
  ;;
esac
