#!/usr/bin/env bash
# The engine against llama.cpp on one H200, on synthetic GGUFs of the 1.1B and 8B llama shapes (bench/synth_gguf.py),
# decode at batch 1. `one` then `two` are consecutive calls to the one warm machine (its /tmp survives between
# them; `two` must follow within the 30 s the machine stays warm):
#
#   bench/h200_synth.sh one    carry .whl .llama: wheels, llama.cpp's llama-bench built in the background (setsid),
#                              the four GGUFs written, the kernel tests on CUDA, the matvec layouts swept
#                              (bench/matvec_bench.py), the engine bench on every file
#   bench/h200_synth.sh two    waits for the build, llama-bench on every file, then engine runs left over
#                              ($ENGINE2: "file@layout ...", layout = MESH_GPU_MV's value), then per-kernel GPU
#                              time of one decode step of the files in $PROFILE_FILES (bench/decode_profile.py),
#                              then bench/mesh_bench.py (1 and 3 peers) on the files in $MESH2
#   bench/h200_synth.sh three  one call on a fresh machine after a kernel change: tests on CUDA, the matvec sweep,
#                              the engine on every file (no llama.cpp: take its figures from a `two`)
#   bench/h200_synth.sh four   a fresh machine: ncu counters of the gate_up matvec (Q8_0, Q4_0), the GPU kernel
#                              tests on CUDA, the sweep fused as the engine fuses, the engine on $ENGINE1
#                              ("file[@layout] ...", layout "cast" = MESH_GPU_CVT=cast)
#   bench/h200_synth.sh ab     a fresh machine: A/B of decode-step changes on the 8B files (see the phase), and
#                              llama.cpp built in the background: follow with `two` on the warm machine
#   bench/h200_synth.sh prof   a fresh machine: decode steps profiled on the 8B files (decode_profile.py, ncu)
#   bench/h200_synth.sh variants  a fresh machine: decode-step variants side by side (bench/decode_ab.py)
#   bench/h200_synth.sh depth  a fresh machine: engine and llama.cpp at contexts 0-64 and 512 (see the phase)
#   bench/h200_synth.sh engine-depth  a fresh machine: the engine alone at contexts 16-80, 32 and 512, tests on CUDA
#   bench/h200_synth.sh s4     a fresh machine: GPU tests, bench/decode_ab.py --greedy A/B of $VARIANTS on the 8B files,
#                              the engine bench, llama-bench tg64 at depths 0 and 512 (built in the background, niced)
#   bench/h200_synth.sh team   a fresh machine: GPU tests, bench/mesh_bench.py and bench/serve_bench.py on $TFILE
#                              (carry .snap with .wx: the mesh's wheels the image lacks), then the engine on $PFILES.
#                              mesh_bench's peers (`python -m mesh peer` with a token) import aiortc: put aiortc, av
#                              and their dependencies in .wx too, or the peers die silently and mesh_bench waits
#   bench/h200_synth.sh s5     a fresh machine (fifth session's kernels): llama.cpp built in the background with LLAMA=1, the
#                              GPU tests on CUDA, bench/matvec_sass.py there too, decode_ab A/B of the word decode
#                              against MESH_GPU_CVT=byte on the 8B files, the engine bench on them, serve_bench local
#                              on 1.1b-Q8_0 with MESH_GPU_MV_COLS=1 and the default 4, then llama-bench tg64
#   bench/h200_synth.sh s6     a fresh machine (sixth session): llama.cpp built in the background, GPU tests and
#                              bench/word_decode_check.py on CUDA, serve_bench local A/B ($SERVE_AB) on 1.1b-Q8_0
#   bench/h200_synth.sh s6b    the warm machine after s6: engine_bench --llama-bench (the ratio in one run) on
#                              $S6_FILES, mesh_bench on $MESH2
#   bench/h200_synth.sh s7     a fresh machine (sixth session, issue 11): the batch matvec (engine/matvec_gpu_wide.py) on
#                              1.1b-Q8_0 only: GPU tests on CUDA, serve_bench local 1,16 with the defaults, decode_ab of
#                              a 16-column step for each variant of $AB_VARIANTS and of a 1-column step, serve_bench with
#                              64 partial sums a row (MESH_GPU_MV=8,64) and with the old kernel (a column a thread
#                              block), then the matvecs alone at 16 columns
#                              (matvec_bench --n 16 for each of $MV_WIDES) as time allows; ~8 minutes
#   bench/h200_synth.sh s8     a fresh machine: llama.cpp and the 8B files in the background, word_decode_check, then
#                              s7 in the time left; follow with s6b
#   bench/h200_synth.sh s9     a fresh machine: decode_profile (parts, --kernels, ncu) of the 8B Q4_0 step, and ncu of a
#                              16-column step of the 1.1B Q8_0 file (issue 11): where the time goes, before a change
#   bench/h200_synth.sh tc     a fresh machine: the tensor-core matvec (engine/matvec_gpu_tc.py): tests and SASS on CUDA,
#                              bench/matvec_bench.py --tc on the 8B and 1.1B shapes at 1 and 16 columns ($TC_RUNS;
#                              $TC_LAYOUTS="8:2048,16:2048,8:512": SPLIT:WARPS of the tensor-core kernel swept)
#   bench/h200_synth.sh tc2    a fresh machine: the engine with MESH_GPU_MV=tc against without: serve_bench local 1,16
#                              on 1.1b-Q8_0, then the engine bench on 8b-Q4_0 and 8b-Q8_0, time allowing
#   bench/h200_synth.sh s10    a fresh machine (eighth session): llama.cpp built first (not niced), the 8B files
#                              written meanwhile, then engine_bench --llama-bench on each with nothing else running:
#                              issue 9's ratio in one run (~320 s)
#   bench/h200_synth.sh s10b   the warm machine after s10: engine_bench --llama-bench on $LB10B, mesh_bench on $MESH10
#                              ($MESH_AB10: --ab), sched_overhead's worker split on $SCHED10
#   bench/h200_synth.sh final  one call, side by side: llama-bench built while the engine runs $ENGINE1 and the
#                              tests run, then llama-bench on every file. The engine runs slower beside the build
#                              (a step is partly host-bound): for the table, rerun the engine on the warm machine.
#   bench/h200_synth.sh s11    ninth session (issue 11), a fresh machine: the 16-stream step of 1.1b-Q8_0 on the tensor
#                              cores: serve_bench local 1,16 with the warmup's runs (the CUDA graphs built at load) and
#                              without (MESH_WARM_RUN=0), sched_overhead's worker split (the child's own step beside
#                              the parent's), a serving-like 16-column step taken apart (decode_profile --spread
#                              --cprofile), then the bare steps. The device gets /work/main's checkout, not a helper's
#                              worktree: land first, then run from the repository root (carry .whl .wx)
#   bench/h200_synth.sh s12    tenth session (issues 11 and 10), a fresh machine: the lean CUDA graph
#                              (engine/cuda_graph.py): tests/test_cuda_graph.py on CUDA (bits equal tinygrad's graph),
#                              the serving-like 16-column and the 1-column step with MESH_LEAN_GRAPH=0 and 1
#                              (decode_profile --cprofile), then serve_bench local 1,16 lean / tinygrad's / lean
#   bench/h200_synth.sh s12b   a fresh machine: 8b-Q4_0 written in the background; ncu kernel time of the 1.1b-Q8_0
#                              serving-like 16-column and the 1-column step (tensor cores: what a column adds on the
#                              GPU), then bench/mesh_bench.py 1 and 3 peers on 8b-Q4_0 with the stage in the peer
#                              (issue 10, lean graphs)
#   bench/h200_synth.sh s12c   a fresh machine: bench/stage_ab.py (tinygrad's CUDA graph against the lean one in one
#                              process, a step split into inputs / launch / wait) on the 8B middle third, the 1.1B
#                              whole at 1 column and at 16 columns on the tensor cores
#   bench/h200_synth.sh s12d   a fresh machine: the 8B Q4_0 split [0,11,22,32] in one process (engine_bench's split:
#                              the partial steps' own cost, one CUDA context), then mesh_bench 1 and 3 peers with the
#                              lean graph against tinygrad's (--ab MESH_LEAN_GRAPH=0; issue 10)
#   bench/h200_synth.sh s12e   a fresh machine: mesh_bench 1 and 3 peers on 8b-Q4_0 with hot waits that spin
#                              (--ab MESH_SPIN_US=$SPIN_US, default 5000: the whole wait between a peer's steps)
#   bench/h200_synth.sh s12f   a fresh machine, the session's last tree: tests/test_cuda_graph.py on CUDA,
#                              then serve_bench local 1,16 on 1.1b-Q8_0 (tc)
#   bench/h200_synth.sh s13    eleventh session (issue 11), a fresh machine: the tensor-core matvec at 16 columns with
#                              more row tiles a warp (MESH_GPU_TC_WARPS swept: R tiles share a warp's x pieces and
#                              change no sum): the serving-like 16-column step of 1.1b-Q8_0 for each WARPS of
#                              $S13_WARPS (decode_profile --spread), the tc tests on CUDA, the 1.1B matrices alone
#                              (matvec_bench --tc-layouts $S13_LAYOUTS), serve_bench --ab-env $S13_SERVE_AB if set
#   bench/h200_synth.sh s13d   a fresh machine: ncu kernel durations of the 16- and 1-column 1.1b-Q8_0 steps (tc), the
#                              tc kernels left out by name, then the 16-column step's own time
#   bench/h200_synth.sh s13b   a fresh machine: serve_bench local 1,16 on 1.1b-Q8_0 (tc), rounds alternating with and
#                              without $S13B_AB (default MESH_GPU_TC_WARPS=2048), then tests/test_matvec_tc.py on CUDA
#   bench/h200_synth.sh s14    a fresh machine: the tc matvec's blocks U a loop step (MESH_GPU_TC_UNROLL) and the split
#                              attention's skipped chunks (MESH_GPU_ATTN_SKIP): bits on CUDA, the 1.1B matrices at 16 and
#                              1 columns for U = 1, 2, 4, ncu --set full of gate_up at 16 columns, decode_ab of U
#   bench/h200_synth.sh s14b   a fresh machine: serve_bench local 1,16 with and without $S14B_AB, rounds alternating, then
#                              the serving-like 16-column step for MESH_GPU_ATTN_SKIP in $S14B_SKIPS, the tests on CUDA
#   bench/h200_synth.sh s14c   a fresh machine: the matrices alone for $S14C_MV16 / $S14C_MV1, ncu of gate_up, decode_ab
#                              of $S14C_VARIANTS at 16 and 1 column, the serving-like step with the attention's skip on/off
#   bench/h200_synth.sh s14d   a fresh machine: decode_ab of the tc kernel's SPLIT / GROUP / UNROLL at 16 and 1 column on
#                              1.1b-Q8_0, then on 8b-Q4_0 (written meanwhile)
#   bench/h200_synth.sh s16    sixteenth session (issue 11), a fresh machine: the tensor-core matvec with x in 8 bits
#                              (engine/matvec_gpu_s8.py, MESH_GPU_TC_X8=1): its tests on CUDA, the 1.1B matrices at
#                              16 and 1 columns (bf16 and s8 side by side), decode_ab of the s8 stage at 16 and 1 column
#   bench/h200_synth.sh s16b   a fresh machine: the s8 tests on CUDA, decode_ab of the 1.1B step bf16 against s8,
#                              serve_bench 1,16 on 1.1b-Q8_0 with and without MESH_GPU_TC_X8=1, then the 8B Q4_0 step
#   bench/h200_synth.sh s17    a fresh machine: bench/s8_bisect.py on CUDA (which s8 kernel parts a sequence's bits alone
#                              and batched), the serving-stage tests on CUDA, decode_ab of the 8B Q4_0 step bf16 vs s8
#   bench/h200_synth.sh s17b   a fresh machine: the tc/s8/CUDA-graph tests on CUDA, serve_bench 1,16 on 1.1b-Q8_0 and
#                              8b-Q4_0, 8-bit x (the default) against MESH_GPU_TC_X8=0
#   bench/h200_synth.sh s17c   a fresh machine: the serving-stage tests on CUDA, serve_bench 1,16 on 1.1b-Q8_0, s8 vs bf16
#   bench/h200_synth.sh s17d   a fresh machine: serve_bench 1,16 on 8b-Q4_0 with the defaults (s8)
#   bench/h200_synth.sh s17e   a fresh machine: s8_bisect on CUDA, the s8/tc/CUDA-graph tests on CUDA (the last tree)
#   bench/h200_synth.sh s18    a fresh machine: the 8B 3-peer chain with and without the hot sink, serve_bench's chain rows
#   bench/h200_synth.sh s19    a fresh machine: the hot sink's A/A, then its A/B, on the 8B 3-peer chain; serve_bench local 1,16
#   bench/h200_synth.sh s20    a fresh machine: issue 11's whole table (1.1B Q8_0, 1/4/8/16 streams, local and chain)
#   bench/h200_synth.sh s20b   a fresh machine: one hop's latency (hop_bench), the writer's yield A/B both ways on the 8B chain
#   bench/h200_synth.sh s15    a fresh 4-GPU machine (kind nvidia-h200-x4): issue 10's 8B chain with a GPU a peer
#                              (mesh_bench --gpus 1,2,3), then all peers on one GPU; ~8 minutes
# Send the committed tree, not the shared checkout (other helpers' unfinished edits travel with it otherwise):
#   echo /.snap/ >> .git/info/exclude; rm -rf .snap; mkdir .snap; git archive HEAD | tar -x -C .snap
#   run: cd .snap && ln -sf ../.whl .whl && ln -sf ../.llama .llama && bash bench/h200_synth.sh final
#   (carry .snap .whl .llama)
#
# .whl holds tinygrad 0.14.0 and gguf 0.19.0 (numpy, tokenizers, jinja2, pyyaml, requests, tqdm are on the image);
# .llama/lc.tgz holds llama.cpp as vendored by llama-cpp-python 0.3.36's sdist, without models/docs/tests/other
# backends (5.7 MB; the sdist is 77 MB), made here with
#   .venv/bin/python -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .llama
#   tar xzf the sdist; cp -r its vendor/llama.cpp .llama/lc; in lc: rm -rf models docs media .github benches tests
#   examples pocs conversion tools/ui tools/server/public*, and ggml/src/ggml-{openvino,webgpu,et,metal,hexagon,sycl,
#   vulkan,opencl,cann,musa,zdnn,zendnn,virtgpu,rpc}; tar czf .llama/lc.tgz -C .llama lc   (/.llama/ is excluded)
# Everything printed lands in $OUT too.
set -u
phase=${1:?one, two, three, four, ab, prof, variants, depth, engine-depth, final, s4, s5, s6, s6b, s7, s8, s9, s9b, s9c, s10, s10b, s11, s12, s12b, s12c, s12d, s12e, s12f, s13, s13b, s13d, s14, s14b, s14c, s14d, s15, s16, s16b, s17, s17b, s17c, s17d, s17e, s18, s19, s20, s20b, tc, tc2 or team}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
T0=$(date +%s)
left() { echo $((${BUDGET:-560} - ($(date +%s) - T0))); }
M=/tmp/m; mkdir -p $M
FILES=${FILES:-"1.1b-Q8_0 1.1b-Q4_0 8b-Q8_0 8b-Q4_0"}

if [ ! -f /tmp/site/.done ]; then  # .wx: the mesh's own dependencies the image lacks (trio, cryptography...), for `team`
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .wx/*.whl 2>/dev/null) && touch /tmp/site/.done || exit 1
fi

engine() {  # engine <file> <log name> [layout]
  local lim=$(( $(left) - 5 )); [ "$lim" -gt 30 ] || { echo "skip engine $1 ${3:-}: no time"; return; }
  [ "$lim" -gt 240 ] && lim=240
  echo "== engine $1 layout ${3:-default} (limit ${lim}s)"
  MESH_GPU_MV=${3:-} MESH_GPU_CVT=$([ "${3:-}" = cast ] && echo cast) DEV=CUDA timeout $lim python3 bench/engine_bench.py --model $M/$1.gguf --synthetic-prompt 16 \
    --tokens 64 --ctx 256 --skip llama,memory,batch,split 2>&1 | grep -v Warning | tee -a "$OUT/$2"
}

decode_ab_depths() {  # decode_ab_depths <file>: bench/decode_ab.py's base at contexts 32 and 512, time allowing
  local lim=$(( $(left) - 5 )); [ "$lim" -gt 50 ] || { echo "skip decode_ab $1: no time"; return; }
  [ "$lim" -gt 150 ] && lim=150
  echo "== decode_ab $1 (limit ${lim}s)"
  DEV=CUDA timeout $lim python3 bench/decode_ab.py --model $M/$1.gguf --variant base= --rounds 2 --steps 20 \
    --positions 32,512 2>&1 | grep -v "Warning\|^variant" | tee -a "$OUT/ab.txt"
}

llamabench() {  # every file once, when the build is there and time is left
  [ -f /tmp/lb.done ] && return
  [ "$(cat /tmp/lc.rc 2>/dev/null)" = 0 ] || { echo "llama-bench not built yet: $(tail -1 /tmp/lc.log)"; return; }
  for f in $FILES; do
    [ "$(left)" -gt 40 ] || return
    echo "== llama-bench $f"
    timeout 100 /tmp/lc/b/bin/llama-bench -m $M/$f.gguf -p 0 -n 64 -ngl 99 -r 5 2>&1 \
      | grep -v "^ggml_\|^load\|^llama_" | tee -a "$OUT/llama_bench.txt"
  done
  touch /tmp/lb.done
}

profile() {  # profile <file>: one decode step's GPU time per kernel kind (bench/decode_profile.py)
  local lim=$(( $(left) - 5 )); [ "$lim" -gt 40 ] || { echo "skip profile $1: no time"; return; }
  [ "$lim" -gt 150 ] && lim=150
  echo "== profile $1"
  DEV=CUDA timeout $lim python3 bench/decode_profile.py --model $M/$1.gguf 2>&1 | grep -v Warning | tee -a "$OUT/profile.txt"
}

lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }  # lim <most>: seconds for the next step
synth_once() {  # synth_once <file> <shape> <type> [log]: bench/synth_gguf.py writes $M/<file>.gguf once a machine
  [ -f $M/.$1 ] || { python3 bench/synth_gguf.py $M/$1.gguf --shape $2 --type $3 > "$OUT/${4:-synth.txt}" 2>&1; touch $M/.$1; }
}

tc_ab() {  # tc_ab <file> <batch> <limit> <variant...>: bench/decode_ab.py of tensor-core stage variants, time allowing
  local f=$1 b=$2 l=$(( $(left) - 10 )); [ "$l" -gt "$3" ] && l=$3; shift 3
  [ "$l" -gt 50 ] || { echo "skip decode_ab $f batch $b: no time"; return; }
  echo "== decode_ab $f $b columns at 128: $* (limit ${l}s)"
  local args=(); for v in "$@"; do args+=(--variant "$v"); done
  MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/decode_ab.py --model $M/$f.gguf --batch $b --positions 128 \
    --rounds 3 --steps 20 --greedy "${args[@]}" 2>&1 | grep -v Warning | tee -a "$OUT/ab.txt"
}

case $phase in
one)
  {
    date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -V; nproc; df -h /tmp | tail -1; free -g | head -2
  } 2>&1 | tee "$OUT/env.txt"
  if [ ! -f /tmp/lc.started ]; then
    touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
    setsid nohup bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      && cmake --build b -j10 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  fi
  for f in 1.1b-Q8_0 1.1b-Q4_0; do python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-}; done 2>&1 | tee "$OUT/synth.txt"
  ( for f in 8b-Q8_0 8b-Q4_0; do python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-}; done \
    >> "$OUT/synth.txt" 2>&1; touch $M/.8b ) &
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore \
    tests/test_engine_quant.py tests/test_matvec_gpu.py 2>&1 | grep -v "Warning\|warn" | tail -8 | tee "$OUT/pytest_cuda.txt"
  DEV=CUDA timeout 170 python3 bench/matvec_bench.py --shape 8b --types Q8_0,Q4_0 --ceiling \
    --layouts ${LAYOUTS:-default,8:256,4:512} 2>&1 | grep -v Warning > "$OUT/matvec.txt"
  sed -n '/^summary/,$p' "$OUT/matvec.txt"
  while [ ! -f $M/.8b ]; do sleep 2; done; ls -la $M
  for f in ${ENGINE1:-8b-Q4_0 8b-Q8_0 1.1b-Q8_0 1.1b-Q4_0}; do engine $f engine.txt; done
  llamabench
  echo "elapsed $(( $(date +%s) - T0 )) s; build: $(tail -2 /tmp/lc.log)"
  ;;
three)  # a kernel change measured again on a fresh machine: tests on CUDA, the sweep, the engine (no llama.cpp)
  for f in 1.1b-Q8_0 1.1b-Q4_0; do python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-}; done 2>&1 | tee "$OUT/synth.txt"
  ( for f in 8b-Q4_0 8b-Q8_0; do python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-}; done \
    >> "$OUT/synth.txt" 2>&1; touch $M/.8b ) &
  DEV=CUDA timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_engine_quant.py \
    tests/test_engine_stage.py 2>&1 | grep -v "Warning\|warn" | tail -8 | tee "$OUT/pytest_cuda.txt"
  DEV=CUDA timeout 120 python3 bench/matvec_bench.py --shape 8b --types Q8_0,Q4_0 \
    --layouts ${LAYOUTS:-16:auto,16:auto:c,16:64:c} 2>&1 | grep -v Warning > "$OUT/matvec.txt"
  sed -n '/^summary/,$p' "$OUT/matvec.txt"
  while [ ! -f $M/.8b ]; do sleep 2; done
  for f in 1.1b-Q8_0 1.1b-Q4_0 8b-Q4_0 8b-Q8_0; do engine $f engine.txt; done
  echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
final)  # one machine, side by side: llama-bench built in the background while the engine runs every file and the
  # GPU kernel tests run on CUDA, then llama-bench on every file
  date -u | tee "$OUT/env.txt"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/env.txt"
  touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
  setsid nohup bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j12 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  for f in $FILES; do python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-}; done 2>&1 | tee "$OUT/synth.txt"
  for spec in ${ENGINE1:-8b-Q8_0 8b-Q4_0 1.1b-Q8_0 1.1b-Q4_0}; do engine ${spec%%@*} engine.txt ${spec#*@}; done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_gpu.py \
    tests/test_engine_quant.py -k "gpu or matvec" 2>&1 | grep -v "Warning\|warn" | tail -4 | tee "$OUT/pytest_cuda.txt"
  while [ ! -f /tmp/lc.rc ] && [ "$(left)" -gt 100 ]; do sleep 5; done
  llamabench
  echo "elapsed $(( $(date +%s) - T0 )) s; build: $(tail -1 /tmp/lc.log)"
  ;;
four)  # a fresh machine after a kernel change: hardware counters of two matvecs (ncu), the GPU kernel tests on CUDA,
  # the layout sweep fused as the engine fuses, then the engine on $ENGINE1 ("file[@layout] ...")
  for f in 1.1b-Q8_0 1.1b-Q4_0; do python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-}; done 2>&1 | tee "$OUT/synth.txt"
  ( for f in 8b-Q4_0 8b-Q8_0; do python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-}; done \
    >> "$OUT/synth.txt" 2>&1; touch $M/.8b ) &
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  for qt in Q8_0 Q4_0; do
    echo "== ncu $qt gate_up, ${NCU_LAYOUT:-default}"
    DEV=CUDA timeout 90 $NCU --clock-control none --kernel-name regex:mv_ --launch-count 1 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
      python3 bench/matvec_bench.py --shape 8b --types $qt --mats gate_up --layouts ${NCU_LAYOUT:-default} --reps 1 \
      2>&1 | grep -v "Warning\|^==PROF==" >> "$OUT/ncu.txt"
  done
  grep -E "^  mv_|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Block Limit" "$OUT/ncu.txt"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 100 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_gpu.py \
    2>&1 | grep -v "Warning\|warn" | tail -4 | tee "$OUT/pytest_cuda.txt"
  DEV=CUDA timeout 200 python3 bench/matvec_bench.py --shape 8b --types Q8_0,Q4_0 --mats qkv,o,gate_up,down --as-engine \
    --layouts ${LAYOUTS:-default,16:256,32:256,8:256:2,8:128} 2>&1 | grep -v Warning > "$OUT/matvec.txt"
  sed -n '/^summary/,$p' "$OUT/matvec.txt"
  while [ ! -f $M/.8b ]; do sleep 2; done
  for spec in ${ENGINE1:-8b-Q8_0 8b-Q4_0 1.1b-Q8_0 1.1b-Q4_0}; do engine ${spec%%@*} engine.txt ${spec#*@}; done
  echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
ab)  # a fresh machine, A/B of decode-step changes on the 8B shape: llama.cpp built in the background (for `two`),
  # the 8B files written, tinygrad's NV backend tried, the GPU tests on CUDA, then bench/decode_profile.py (the jitted
  # step taken apart) for each "DEV@MESH_FUSE_GLU[@k]" of $AB4 on 8b-Q4_0 and of $AB8 on 8b-Q8_0 (k: per-kernel times)
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } 2>&1 | tee "$OUT/env.txt"
  touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
  setsid nohup nice -n 15 bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j10 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  for f in 8b-Q4_0 8b-Q8_0; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  echo "== NV smoke"; DEV=NV timeout 90 python3 -c 'from tinygrad import Device, Tensor; print(Device.DEFAULT, (Tensor([1., 2., 3.]) * 2).tolist())' 2>&1 | tail -3 | tee "$OUT/nv.txt"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_gpu.py \
    2>&1 | grep -v "Warning\|warn" | tail -4 | tee "$OUT/pytest_cuda.txt"
  for pair in "8b-Q4_0:${AB4:-CUDA@0@k CUDA@1@k NV@1}" "8b-Q8_0:${AB8:-CUDA@1 NV@1}"; do
    f=${pair%%:*}
    while [ ! -f $M/.$f ]; do sleep 2; done
    for spec in ${pair#*:}; do
      IFS=@ read -r dev glu k <<< "$spec"
      lim=$(( $(left) - 5 )); [ "$lim" -gt 40 ] || { echo "skip $f $spec: no time"; continue; }; [ "$lim" -gt 200 ] && lim=200
      echo "== profile $f DEV=$dev MESH_FUSE_GLU=$glu (limit ${lim}s)"
      DEV=$dev MESH_FUSE_GLU=$glu timeout $lim python3 bench/decode_profile.py --model $M/$f.gguf ${k:+--kernels} 2>&1 \
        | grep -v Warning | tee -a "$OUT/profile.txt"
    done
  done
  llamabench
  echo "elapsed $(( $(date +%s) - T0 )) s; build: $(tail -1 /tmp/lc.log)"
  ;;
prof)  # a fresh machine, where a decode step's GPU time goes: for each file of $PFILES and each MESH_FUSE_GLU of
  # $GLUS, bench/decode_profile.py --kernels (the jitted step taken apart, then each kernel unjitted), then ncu's
  # kernel durations of 3 jitted decode steps summed per kernel kind (--ncu, --summarize)
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } 2>&1 | tee "$OUT/env.txt"
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    for glu in ${GLUS:-0 1}; do
      lim=$(( $(left) - 5 )); [ "$lim" -gt 40 ] || { echo "skip $f $glu: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
      echo "== profile $f MESH_FUSE_GLU=$glu (limit ${lim}s)"
      DEV=CUDA MESH_FUSE_GLU=$glu timeout $lim python3 bench/decode_profile.py --model $M/$f.gguf --kernels 2>&1 \
        | grep -v Warning | tee -a "$OUT/profile.txt"
    done
    lim=$(( $(left) - 5 )); [ "$lim" -gt 50 ] || { echo "skip ncu $f: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== ncu $f (limit ${lim}s)"
    DEV=CUDA timeout $lim $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
      python3 bench/decode_profile.py --model $M/$f.gguf --ncu --steps 3 > "$OUT/ncu_$f.csv" 2>&1
    python3 bench/decode_profile.py --model x --summarize "$OUT/ncu_$f.csv" --steps 3 2>&1 | tee -a "$OUT/profile.txt"
  done
  echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
variants)  # a fresh machine: bench/decode_ab.py on each file of $PFILES with the variants of $VARIANTS
  # ("name=KEY=VALUE;KEY=VALUE name2=..."), all captured in one process per file and timed in interleaved rounds
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } 2>&1 | tee "$OUT/env.txt"
  for f in ${PFILES:-8b-Q8_0 8b-Q4_0}; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA MESH_GPU_MV_SMALL=8,512 timeout 100 python3 -m pytest -q -p no:cacheprovider -W ignore \
    tests/test_matvec_gpu.py 2>&1 | grep -v "Warning\|warn" | tail -3 | tee "$OUT/pytest_cuda.txt"
  for f in ${PFILES:-8b-Q8_0 8b-Q4_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip $f: no time"; continue; }; [ "$lim" -gt 280 ] && lim=280
    echo "== decode_ab $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/decode_ab.py --model $M/$f.gguf $(for v in $VARIANTS; do echo "--variant $v"; done) \
      --rounds ${ROUNDS:-3} --steps ${STEPS:-20} 2>&1 | grep -v Warning | tee -a "$OUT/ab.txt"
  done
  echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
depth)  # a fresh machine, side by side at two context lengths: llama.cpp built first (nothing else heavy runs
  # beside the timed runs), llama-bench tg64 from an empty context and after 512 tokens (-d 0,512), the engine bench
  # (decode at positions 16-80), and bench/decode_ab.py's decode step at contexts 32 and 512, on each of $PFILES
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } 2>&1 | tee "$OUT/env.txt"
  tar xzf .llama/lc.tgz -C /tmp
  setsid nohup bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j16 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  for f in ${PFILES:-8b-Q8_0 8b-Q4_0}; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 100 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_gpu.py \
    2>&1 | grep -v "Warning\|warn" | tail -3 | tee "$OUT/pytest_cuda.txt"
  while [ ! -f /tmp/lc.rc ] && [ "$(left)" -gt 200 ]; do sleep 5; done
  echo "llama.cpp build: rc $(cat /tmp/lc.rc 2>/dev/null), $(( $(date +%s) - T0 )) s"
  for f in ${PFILES:-8b-Q8_0 8b-Q4_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    [ "$(cat /tmp/lc.rc 2>/dev/null)" = 0 ] && [ "$(left)" -gt 60 ] && { echo "== llama-bench $f"; timeout 100 \
      /tmp/lc/b/bin/llama-bench -m $M/$f.gguf -p 0 -n 64 -d 0,512 -ngl 99 -r 5 2>&1 | grep -v "^ggml_\|^load\|^llama_" \
      | tee -a "$OUT/llama_bench.txt"; }
  done
  for f in ${PFILES:-8b-Q8_0 8b-Q4_0}; do
    engine $f engine.txt
    decode_ab_depths $f
  done
  echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
engine-depth)  # a fresh machine, the engine alone (no llama.cpp: take its figures from a `depth` run): the tests
  # of $TESTS on CUDA, then the engine bench and bench/decode_ab.py at contexts 32 and 512 on each of $PFILES
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; git log -1 --format=%H 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"
  for f in ${PFILES:-8b-Q8_0 8b-Q4_0}; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore ${TESTS:-tests/test_matvec_gpu.py} \
    2>&1 | grep -v "Warning\|warn" | tail -6 | tee "$OUT/pytest_cuda.txt"
  for f in ${PFILES:-8b-Q8_0 8b-Q4_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    engine $f engine.txt
    decode_ab_depths $f
  done
  echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s4)  # fourth session, a fresh machine: llama.cpp built in the background (niced), the 8B files written, the GPU
  # kernel tests on CUDA, then per 8B file bench/decode_ab.py --greedy with $VARIANTS (the step's new parts switched
  # off one by one), the engine bench, and llama-bench (tg64 at depth 0 and 512) once built
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } 2>&1 | tee "$OUT/env.txt"
  touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
  setsid nohup nice -n 19 bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j10 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 170 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_attention_gpu.py \
    tests/test_device_greedy.py tests/test_kv_paging.py tests/test_matvec_gpu.py 2>&1 | grep -v "Warning\|warn" | tail -12 | tee "$OUT/pytest_cuda.txt"
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip $f: no time"; continue; }; [ "$lim" -gt 170 ] && lim=170
    echo "== decode_ab $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/decode_ab.py --model $M/$f.gguf --greedy $(for v in $VARIANTS; do echo "--variant $v"; done) \
      --rounds ${ROUNDS:-3} --steps ${STEPS:-20} --positions 32,512 2>&1 | grep -v Warning | tee -a "$OUT/ab.txt"
  done
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do engine $f engine.txt; done
  while [ ! -f /tmp/lc.rc ] && [ "$(left)" -gt 100 ]; do sleep 5; done
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    [ "$(cat /tmp/lc.rc 2>/dev/null)" = 0 ] && [ "$(left)" -gt 50 ] && { echo "== llama-bench $f"; timeout 80 \
      /tmp/lc/b/bin/llama-bench -m $M/$f.gguf -p 0 -n 64 -d 0,512 -ngl 99 -r 5 2>&1 | grep -v "^ggml_\|^load\|^llama_" \
      | tee -a "$OUT/llama_bench.txt"; }
  done
  echo "elapsed $(( $(date +%s) - T0 )) s; build: $(tail -1 /tmp/lc.log)"
  ;;
team)  # the team's figures on main's HEAD, a fresh machine: the GPU tests, bench/mesh_bench.py (lockstep, 1 and 3
  # peers, every process on the one GPU) and bench/serve_bench.py (1..16 streams, local and a 3-peer chain) on
  # $TFILE (default 1.1b-Q8_0; the SmolLM2 file is over a call's 64 MiB), then the engine on $PFILES as time allows
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  TF=${TFILE:-1.1b-Q8_0}
  python3 bench/synth_gguf.py $M/$TF.gguf --shape ${TF%-*} --type ${TF#*-} > "$OUT/synth_$TF.txt" 2>&1
  for f in ${PFILES:-}; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_attention_gpu.py \
    tests/test_device_greedy.py tests/test_kv_paging.py tests/test_matvec_gpu.py 2>&1 | grep -v "Warning\|warn" | tail -6 | tee "$OUT/pytest_cuda.txt"
  lim=$(( $(left) - 5 )); [ "$lim" -gt 220 ] && lim=220
  echo "== mesh_bench $TF (limit ${lim}s)"; uptime
  DEV=CUDA timeout $lim python3 bench/mesh_bench.py --model $M/$TF.gguf --peers ${PEERS:-1,3} --rounds 3 --tokens 64 2>&1 \
    | grep -v Warning | tee "$OUT/mesh.txt"
  lim=$(( $(left) - 5 )); [ "$lim" -gt 300 ] && lim=300
  echo "== serve_bench $TF (limit ${lim}s)"; uptime
  DEV=CUDA timeout $lim python3 bench/serve_bench.py --model $M/$TF.gguf --streams 1,4,8,16 --modes ${MODES:-local,chain} 2>&1 \
    | grep -v Warning | tee "$OUT/serve.txt"
  for f in ${PFILES:-}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    engine $f engine.txt
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s5)  # fifth session: the word decode (Q4_0/Q8_0) and column tiles (batches) of engine/matvec_gpu.py, one fresh machine
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  # llama.cpp only with LLAMA=1: a build beside the engine slows it 7-11%, and its tg64 read 252.2-256.1 (8B Q8_0)
  # and 342.1-345.1 (8B Q4_0) on four machines of two sessions
  [ "${LLAMA:-0}" = 1 ] && { touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
  setsid nohup nice -n 19 bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j8 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null & }
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0} 1.1b-Q8_0; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_gpu.py \
    tests/test_attention_gpu.py tests/test_device_greedy.py 2>&1 | grep -v "Warning\|warn" | tail -6 | tee "$OUT/pytest_cuda.txt"
  PATH=$PATH:/usr/local/cuda/bin timeout 60 python3 bench/matvec_sass.py --types Q4_0,Q8_0 --cols 16384 --n 1,4 2>&1 | tail -4 | tee "$OUT/sass.txt"
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip $f: no time"; continue; }; [ "$lim" -gt 120 ] && lim=120
    echo "== decode_ab $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/decode_ab.py --model $M/$f.gguf --greedy --variant word= --variant byte=MESH_GPU_CVT=byte \
      --rounds 3 --steps 20 --positions 32,512 2>&1 | grep -v Warning | tee -a "$OUT/ab.txt"
  done
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do engine $f engine.txt; done
  while [ ! -f $M/.1.1b-Q8_0 ]; do sleep 2; done
  for c in 1 4; do
    lim=$(( $(left) - 60 )); [ "$lim" -gt 40 ] || { echo "skip serve cols $c: no time"; continue; }; [ "$lim" -gt 120 ] && lim=120
    echo "== serve_bench 1.1b-Q8_0 local MESH_GPU_MV_COLS=$c (limit ${lim}s)"
    MESH_GPU_MV_COLS=$c DEV=CUDA timeout $lim python3 bench/serve_bench.py --model $M/1.1b-Q8_0.gguf --streams 1,16 --modes local 2>&1 \
      | grep -v Warning | tee -a "$OUT/serve.txt"
  done
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    [ "$(cat /tmp/lc.rc 2>/dev/null)" = 0 ] && [ "$(left)" -gt 40 ] && { echo "== llama-bench $f"; timeout 60 \
      /tmp/lc/b/bin/llama-bench -m $M/$f.gguf -p 0 -n 64 -ngl 99 -r 5 2>&1 | grep -v "^ggml_\|^load\|^llama_" \
      | tee -a "$OUT/llama_bench.txt"; }
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s; build: $(tail -1 /tmp/lc.log 2>/dev/null)"
  ;;
s7)  # sixth session, issue 11's 16 streams >= 10x one: the batch kernel on one fresh machine, 1.1b-Q8_0 only
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  ( python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth_$F.txt" 2>&1; touch $M/.$F ) &
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 130 python3 -m pytest -q -p no:cacheprovider -W ignore -rf tests/test_matvec_gpu.py \
    2>&1 | grep -v "Warning\|warn" | tail -8 | tee "$OUT/pytest_cuda.txt"
  while [ ! -f $M/.$F ]; do sleep 2; done
  serve() {  # serve <name> <settings, ';' between>: serve_bench local 1,16 (every stream checked against itself alone)
    local lim=$(( $(left) - 30 )); [ "$lim" -gt 50 ] || { echo "skip serve $1: no time"; return; }; [ "$lim" -gt 150 ] && lim=150
    echo "== serve_bench $F local, $1 (${2:-defaults}; limit ${lim}s)"; uptime
    env ${2//;/ } DEV=CUDA timeout $lim python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
      2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  }
  serve batch-kernel ""
  # a 16-column decode step per variant, captured in one process and timed in interleaved rounds ("ids vs" the
  # first must read 0); if that process fails (the lead saw variants swapped in one process fail on CUDA in s5),
  # one process a variant. With the 1-column step after it, 16 x t1 / t16
  # is the step's own bound on serve_bench's x16
  ab() {  # ab <limit> <batch> <variant>...
    local lim=$1 b=$2; shift 2
    DEV=CUDA timeout $lim python3 bench/decode_ab.py --model $M/$F.gguf --greedy --batch $b --positions 32,256 --rounds 3 \
      --steps 10 $(for v in "$@"; do echo "--variant $v"; done) 2>&1 | grep -v Warning | tee -a "$OUT/ab.txt"
    return ${PIPESTATUS[0]}
  }
  # s64: every matvec (one column too) in the order of 64 partial sums a row (MESH_GPU_MV=8,64) instead of 256
  VARS=${AB_VARIANTS:-"w16,2=MESH_GPU_MV_WIDE=16,2 tiles1=MESH_GPU_MV_WIDE=0;MESH_GPU_MV_COLS=1 tiles4=MESH_GPU_MV_WIDE=0 w8,2=MESH_GPU_MV_WIDE=8,2 w16,2-s64=MESH_GPU_MV_WIDE=16,2;MESH_GPU_MV=8,64"}
  lim=$(( $(left) - 5 )); [ "$lim" -gt 170 ] && lim=170
  echo "== decode_ab $F --batch 16, one process (limit ${lim}s)"
  ab $lim 16 $VARS; rc=$?
  if [ $rc != 0 ] && [ $rc != 124 ] && [ $rc != 137 ]; then  # a failure, not the time limit
    for v in $VARS; do
      lim=$(( $(left) - 5 )); [ "$lim" -gt 40 ] || { echo "skip decode_ab $v: no time"; continue; }; [ "$lim" -gt 60 ] && lim=60
      echo "== decode_ab $F --batch 16, $v alone (limit ${lim}s)"; ab $lim 16 "$v"
    done
  fi
  lim=$(( $(left) - 5 )); [ "$lim" -gt 30 ] && { [ "$lim" -gt 50 ] && lim=50
    echo "== decode_ab $F --batch 1 (limit ${lim}s)"; ab $lim 1 base= s64=MESH_GPU_MV=8,64; }
  serve s64 "MESH_GPU_MV=8,64"
  serve tiles1 "MESH_GPU_MV_WIDE=0;MESH_GPU_MV_COLS=1"
  lim=$(( $(left) - 5 )); [ "$lim" -gt 30 ] && { [ "$lim" -gt 120 ] && lim=120
    echo "== matvec_bench 1.1b Q8_0 at 16 columns (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/matvec_bench.py --shape 1.1b --types Q8_0 --n 16 --as-engine --reps 10 \
      --wide ${MV_WIDES:-16:2,0,16:1,8:2} 2>&1 | grep -v Warning > "$OUT/matvec.txt"; sed -n '/^summary/,$p' "$OUT/matvec.txt"; }
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
two)
  while [ ! -f /tmp/lc.rc ] && [ "$(left)" -gt 200 ]; do sleep 5; done
  tail -3 /tmp/lc.log; cat /tmp/lc.rc 2>/dev/null
  llamabench
  for spec in ${ENGINE2:-}; do engine ${spec%%@*} engine2.txt ${spec#*@}; done  # file@layout, layout "" = default
  for f in ${PROFILE_FILES:-}; do profile $f; done
  for f in ${MESH2:-}; do  # bench/mesh_bench.py lockstep, 1 and 3 peers on the one GPU (carry .snap with .wx)
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip mesh_bench $f: no time"; continue; }; [ "$lim" -gt 240 ] && lim=240
    echo "== mesh_bench $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/mesh_bench.py --model $M/$f.gguf --peers 1,3 --rounds 2 --tokens 64 2>&1 \
      | grep -v Warning | tee -a "$OUT/mesh.txt"
  done
  echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s6)  # sixth session, a fresh machine: llama.cpp built in the background (nice 19), the files written, the GPU tests
  # and bench/word_decode_check.py on CUDA, then serve_bench local 1,16 streams on 1.1b-Q8_0 for each variant of
  # $SERVE_AB ("name:VAR=VALUE,VAR=VALUE name2:" ...; empty settings = the defaults). Follow with s6b on the warm machine.
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
  setsid nohup nice -n 19 bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j8 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  for f in 1.1b-Q8_0 ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 90 python3 bench/word_decode_check.py 2>&1 | grep -v Warning | tee "$OUT/word_decode.txt"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 180 python3 -m pytest -q -p no:cacheprovider -W ignore -rf tests/test_matvec_gpu.py \
    tests/test_attention_gpu.py tests/test_device_greedy.py 2>&1 | grep -v "Warning\|warn" | tail -12 | tee "$OUT/pytest_cuda.txt"
  while [ ! -f $M/.1.1b-Q8_0 ]; do sleep 2; done
  for spec in ${SERVE_AB:-default:}; do
    name=${spec%%:*}; sets=${spec#*:}
    lim=$(( $(left) - 10 )); [ "$lim" -gt 50 ] || { echo "skip serve $name: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== serve_bench 1.1b-Q8_0 local, $name (${sets:-defaults}; limit ${lim}s)"
    env ${sets//,/ } DEV=CUDA timeout $lim python3 bench/serve_bench.py --model $M/1.1b-Q8_0.gguf --streams 1,16 --modes local \
      2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s; build: $(tail -1 /tmp/lc.log 2>/dev/null)"
  ;;
s6b)  # the warm machine after s6: engine_bench with llama-bench in the same run (--llama-bench: the ratio printed)
  # on $S6_FILES, then bench/mesh_bench.py 1 and 3 peers on $MESH2 with the defaults
  while [ ! -f /tmp/lc.rc ] && [ "$(left)" -gt 300 ]; do sleep 5; done
  tail -2 /tmp/lc.log; cat /tmp/lc.rc 2>/dev/null
  for f in ${S6_FILES:-8b-Q4_0 8b-Q8_0 1.1b-Q8_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip engine $f: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== engine_bench $f with llama-bench (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/engine_bench.py --model $M/$f.gguf --synthetic-prompt 16 --tokens 64 --ctx 256 \
      --skip llama,memory,batch,split --llama-bench /tmp/lc/b/bin/llama-bench 2>&1 | grep -v Warning | tee -a "$OUT/engine.txt"
  done
  for f in ${MESH2:-}; do
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip mesh_bench $f: no time"; continue; }; [ "$lim" -gt 200 ] && lim=200
    echo "== mesh_bench $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/mesh_bench.py --model $M/$f.gguf --peers 1,3 --rounds 2 --tokens 64 \
      ${MESH_AB:+--ab $MESH_AB} 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s8)  # sixth session, one fresh machine for everything: llama.cpp built and the 8B files written in the background
  # (nice 19), bench/word_decode_check.py on CUDA, then the s7 phase (issue 11's batch kernel) in the time left.
  # Follow with `S6_FILES="8b-Q4_0 8b-Q8_0" MESH2=8b-Q4_0 bash bench/h200_synth.sh s6b` on the warm machine.
  touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
  setsid nohup nice -n 19 bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j8 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  for f in ${PFILES:-8b-Q4_0 8b-Q8_0}; do
    ( nice -n 19 python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 90 python3 bench/word_decode_check.py 2>&1 | grep -v Warning | tee "$OUT/word_decode.txt"
  BUDGET=$(left) OUT=$OUT bash "$0" s7
  ;;
s9)  # seventh session, a fresh machine, where the time goes before a kernel change: bench/decode_profile.py on the
  # files of $PFILES (the jitted step's parts, --kernels, then ncu's kernel durations of 3 steps per kernel kind), then
  # ncu of a $BATCH-column step on each file of $BFILES (issue 11: what a batched step spends beside the matvecs)
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  for f in ${PFILES:-8b-Q4_0} ${BFILES:-1.1b-Q8_0}; do
    [ -f $M/.$f ] || ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  ncu_of() {  # ncu_of <file> <batch>
    local lim=$(( $(left) - 5 )); [ "$lim" -gt 50 ] || { echo "skip ncu $1 x$2: no time"; return; }; [ "$lim" -gt 150 ] && lim=150
    echo "== ncu $1 batch $2 (limit ${lim}s)"
    DEV=CUDA timeout $lim $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
      python3 bench/decode_profile.py --model $M/$1.gguf --ncu --steps 3 --batch $2 > "$OUT/ncu_$1_$2.csv" 2>&1
    python3 bench/decode_profile.py --model x --summarize "$OUT/ncu_$1_$2.csv" --steps 3 2>&1 | head -40 | tee -a "$OUT/profile.txt"
  }
  for f in ${PFILES:-8b-Q4_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    lim=$(( $(left) - 5 )); [ "$lim" -gt 40 ] || { echo "skip $f: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== profile $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/decode_profile.py --model $M/$f.gguf --kernels 2>&1 | grep -v Warning | tee -a "$OUT/profile.txt"
    ncu_of $f 1
  done
  for f in ${BFILES:-1.1b-Q8_0}; do
    while [ ! -f $M/.$f ]; do sleep 2; done
    lim=$(( $(left) - 5 )); [ "$lim" -gt 40 ] || { echo "skip $f: no time"; continue; }; [ "$lim" -gt 100 ] && lim=100
    echo "== step of ${BATCH:-16} columns, $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/decode_profile.py --model $M/$f.gguf --batch ${BATCH:-16} 2>&1 | grep -v Warning | tee -a "$OUT/profile.txt"
    ncu_of $f ${BATCH:-16}
    ncu_of $f 1
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s9b)  # seventh session, a fresh machine after a decode-step change: llama.cpp built in the background (nice 19), the
  # files of $FILES9 written, the GPU tests on CUDA, ncu of a 1.1B step, the 8B Q4_0 step's parts, the engine alone on
  # the 8B files, then engine_bench --llama-bench (the ratio in one run) on each of $LB_FILES once the build is done
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
  setsid nohup nice -n 19 bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j8 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  for f in ${FILES9:-1.1b-Q8_0 8b-Q4_0 8b-Q8_0}; do
    [ -f $M/.$f ] || ( python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f ) &
  done
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore -rf tests/test_device_greedy.py \
    tests/test_attention_gpu.py ${TESTS9:-} 2>&1 | grep -v "Warning\|warn" | tail -8 | tee "$OUT/pytest_cuda.txt"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  while [ ! -f $M/.1.1b-Q8_0 ]; do sleep 2; done
  echo "== ncu 1.1b-Q8_0 batch 1"
  DEV=CUDA timeout 120 $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 bench/decode_profile.py --model $M/1.1b-Q8_0.gguf --ncu --steps 3 > "$OUT/ncu_1.1b_1.csv" 2>&1
  python3 bench/decode_profile.py --model x --summarize "$OUT/ncu_1.1b_1.csv" --steps 3 2>&1 | head -30 | tee -a "$OUT/profile.txt"
  while [ ! -f $M/.8b-Q4_0 ]; do sleep 2; done
  echo "== 8b-Q4_0 step parts"
  DEV=CUDA timeout 120 python3 bench/decode_profile.py --model $M/8b-Q4_0.gguf 2>&1 | grep -v Warning | tee -a "$OUT/profile.txt"
  for f in ${ENG9:-8b-Q4_0 8b-Q8_0}; do while [ ! -f $M/.$f ]; do sleep 2; done; engine $f engine.txt; done
  while [ ! -f /tmp/lc.rc ] && [ "$(left)" -gt 150 ]; do sleep 5; done
  tail -2 /tmp/lc.log; cat /tmp/lc.rc 2>/dev/null
  for f in ${LB_FILES:-8b-Q4_0}; do
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip engine_bench --llama-bench $f: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== engine_bench $f with llama-bench (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/engine_bench.py --model $M/$f.gguf --synthetic-prompt 16 --tokens 64 --ctx 256 \
      --skip llama,memory,batch,split --llama-bench /tmp/lc/b/bin/llama-bench 2>&1 | grep -v Warning | tee -a "$OUT/engine.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
tc)  # seventh session (helper tc), a fresh machine: the tensor-core matvec (engine/matvec_gpu_tc.py): its tests on
  # CUDA, its SASS there, then bench/matvec_bench.py --tc (today's kernel and the tensor-core one on the same random
  # weights, each in its own layout, one run: ratio and both errors against float64) on the 8B and 1.1B shapes at 1
  # and 16 columns. Needs no GGUF file; ~6-8 minutes
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_tc.py \
    2>&1 | grep -v "Warning\|warn" | tail -8 | tee "$OUT/pytest_cuda.txt"
  PATH=$PATH:/usr/local/cuda/bin timeout 60 python3 bench/matvec_sass.py --tc --types Q4_0,Q8_0 --rows 28672 \
    --cols 4096 --n 1,16 2>&1 | grep -v Warning | tee "$OUT/sass.txt"
  for run in ${TC_RUNS:-8b:1 1.1b:16 8b:16 1.1b:1}; do
    lim=$(( $(left) - 5 )); [ "$lim" -gt 40 ] || { echo "skip $run: no time"; continue; }; [ "$lim" -gt 170 ] && lim=170
    echo "== matvec_bench --shape ${run%:*} --n ${run#*:} --tc (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/matvec_bench.py --shape ${run%:*} --n ${run#*:} --types Q4_0,Q8_0 --tc \
      --reps 10 ${TC_LAYOUTS:+--tc-layouts $TC_LAYOUTS} 2>&1 | grep -v Warning > "$OUT/matvec_tc_${run%:*}_${run#*:}.txt"
    sed -n '/^summary/,$p' "$OUT/matvec_tc_${run%:*}_${run#*:}.txt" | tee -a "$OUT/matvec_tc.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
tc2)  # seventh session (helper tc), a fresh machine: the engine with the tensor-core matvec (MESH_GPU_MV=tc: weights
  # loaded in its layout, the norm and residual fused) against without, each in its own process: serve_bench local
  # 1,16 streams on 1.1b-Q8_0 (issue 11), then the engine bench on 8b-Q4_0 and 8b-Q8_0 (issue 9), time allowing
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  for f in 1.1b-Q8_0 8b-Q4_0 8b-Q8_0; do  # one after another in the background, the 1.1B first
    [ -f $M/.$f ] || { python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f; }
  done &
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore -rf tests/test_matvec_tc.py \
    2>&1 | grep -v "Warning\|warn" | tail -8 | tee "$OUT/pytest_cuda.txt"
  F=1.1b-Q8_0; while [ ! -f $M/.$F ]; do sleep 2; done
  for mv in MESH_GPU_MV_TC=0 MESH_GPU_MV=tc; do  # serve_bench's stage has 16 slots: tensor cores unless told not to
    lim=$(( $(left) - 30 )); [ "$lim" -gt 50 ] || { echo "skip serve $mv: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== serve_bench $F local, $mv (limit ${lim}s)"; uptime
    env $mv DEV=CUDA timeout $lim python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
      2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  done
  for f in 8b-Q4_0 8b-Q8_0; do
    while [ ! -f $M/.$f ] && [ "$(left)" -gt 60 ]; do sleep 2; done
    engine $f engine.txt; engine $f engine.txt tc
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s9c)  # seventh session's last call, a fresh machine: the tensor-core stage on 1.1b-Q8_0, its CUDA tests, a 16- and a
  # 1-column step with and without (decode_profile --batch), serve_bench local 1,16 with it (a 16-slot stage takes
  # the tensor cores by itself) and without (MESH_GPU_MV_TC=0), then the 8B Q4_0 engine with and without, time
  # allowing
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  for f in 1.1b-Q8_0 8b-Q4_0; do
    [ -f $M/.$f ] || { python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f; }
  done &
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout 70 python3 -m pytest -q -p no:cacheprovider -W ignore -rf tests/test_matvec_tc.py \
    2>&1 | grep -v "Warning\|warn" | tail -6 | tee "$OUT/pytest_cuda.txt"
  F=1.1b-Q8_0; while [ ! -f $M/.$F ]; do sleep 2; done
  # the kernel is chosen per stage at load (engine/matvec_gpu_tc.py tc_stage: several slots on CUDA take the tensor
  # cores): "with" forces it (MESH_GPU_MV=tc), "without" forbids it (MESH_GPU_MV_TC=0), whatever the slots
  for b in 16 1; do for mv in MESH_GPU_MV=tc MESH_GPU_MV_TC=0; do
    lim=$(( $(left) - 10 )); [ "$lim" -gt 30 ] || { echo "skip step $b $mv: no time"; continue; }; [ "$lim" -gt 60 ] && lim=60
    echo "== step of $b columns, $F, $mv"
    env $mv DEV=CUDA timeout $lim python3 bench/decode_profile.py --model $M/$F.gguf --batch $b --steps 20 2>&1 \
      | grep "jitted" | tee -a "$OUT/steps.txt"
  done; done
  lim=$(( $(left) - 10 )); [ "$lim" -gt 150 ] && lim=150
  echo "== serve_bench $F local 1,16, MESH_GPU_MV=tc (limit ${lim}s)"
  MESH_GPU_MV=tc DEV=CUDA timeout $lim python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
    2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  lim=$(( $(left) - 10 )); [ "$lim" -gt 60 ] && {
    [ "$lim" -gt 150 ] && lim=150
    echo "== serve_bench $F local 1,16, MESH_GPU_MV_TC=0 (limit ${lim}s)"
    MESH_GPU_MV_TC=0 DEV=CUDA timeout $lim python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
      2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"; }
  while [ ! -f $M/.8b-Q4_0 ] && [ "$(left)" -gt 60 ]; do sleep 2; done
  engine 8b-Q4_0 engine.txt tc; engine 8b-Q4_0 engine.txt  # engine_bench's decode stage has one slot: the default
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s10)  # eighth session, a fresh machine: issue 9's ratio in one run. llama.cpp built first on every core (not niced)
  # while the files of $FILES10 are written (niced), nothing else beside them; then engine_bench --llama-bench on
  # each file with nothing else running. The build took 276 s this way (at 84% after 345 s with the GPU tests and a
  # third file beside it). Follow with s10b on the warm machine (within its 30 s).
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  touch /tmp/lc.started; tar xzf .llama/lc.tgz -C /tmp
  setsid nohup bash -c 'cd /tmp/lc && cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build b -j16 --target llama-bench; echo $? > /tmp/lc.rc' > /tmp/lc.log 2>&1 < /dev/null &
  for f in ${FILES10:-8b-Q4_0 8b-Q8_0}; do
    [ -f $M/.$f ] || ( setsid nohup bash -c "nice -n 10 python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} \
      > /tmp/synth_$f.txt 2>&1; touch $M/.$f" < /dev/null > /dev/null 2>&1 & )
  done
  while [ ! -f /tmp/lc.rc ] && [ "$(left)" -gt 160 ]; do sleep 3; done
  echo "llama.cpp build: rc $(cat /tmp/lc.rc 2>/dev/null), $(( $(date +%s) - T0 )) s: $(tail -1 /tmp/lc.log)"
  for f in ${FILES10:-8b-Q4_0 8b-Q8_0}; do
    while [ ! -f $M/.$f ] && [ "$(left)" -gt 80 ]; do sleep 2; done
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip engine_bench $f: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== engine_bench $f with llama-bench (limit ${lim}s)"; uptime
    DEV=CUDA timeout $lim python3 bench/engine_bench.py --model $M/$f.gguf --synthetic-prompt 16 --tokens 64 --ctx 256 \
      --skip llama,memory,batch,split,coldstart $([ "$(cat /tmp/lc.rc 2>/dev/null)" = 0 ] && echo --llama-bench /tmp/lc/b/bin/llama-bench) \
      2>&1 | grep -v Warning | tee -a "$OUT/engine.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s10b)  # eighth session, the warm machine after s10: engine_bench --llama-bench on $LB10B, then bench/mesh_bench.py
  # 1 and 3 peers on $MESH10 with the hot sink against without (issue 10), then bench/sched_overhead.py's worker
  # split of a real 16-stream step on $SCHED10 (issue 11), time allowing
  [ -f /tmp/lc.started ] || { echo "not the warm machine after s10 (no build, no files): run s10 first"; exit 1; }
  while [ ! -f /tmp/lc.rc ] && [ "$(left)" -gt 300 ]; do sleep 5; done
  for f in ${LB10B:-1.1b-Q8_0}; do
    [ -f $M/.$f ] || { python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f; }
    lim=$(( $(left) - 5 )); [ "$lim" -gt 80 ] || { echo "skip engine_bench --llama-bench $f: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== engine_bench $f with llama-bench (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/engine_bench.py --model $M/$f.gguf --synthetic-prompt 16 --tokens 64 --ctx 256 \
      --skip llama,memory,batch,split $([ "$(cat /tmp/lc.rc 2>/dev/null)" = 0 ] && echo --llama-bench /tmp/lc/b/bin/llama-bench) \
      2>&1 | grep -v Warning | tee -a "$OUT/engine.txt"
  done
  for f in ${MESH10:-8b-Q4_0}; do
    lim=$(( $(left) - 5 )); [ "$lim" -gt 90 ] || { echo "skip mesh_bench $f: no time"; continue; }; [ "$lim" -gt 220 ] && lim=220
    echo "== mesh_bench $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/mesh_bench.py --model $M/$f.gguf --peers 1,3 --rounds 2 --tokens 64 \
      ${MESH_AB10:+--ab $MESH_AB10} 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  done
  for f in ${SCHED10:-}; do
    lim=$(( $(left) - 5 )); [ "$lim" -gt 60 ] || { echo "skip sched_overhead $f: no time"; continue; }; [ "$lim" -gt 150 ] && lim=150
    echo "== sched_overhead $f (limit ${lim}s)"
    DEV=CUDA timeout $lim python3 bench/sched_overhead.py --modes worker --model $M/$f.gguf --device CUDA \
      --streams 1,16 --rounds 2 2>&1 | grep -v Warning | tee -a "$OUT/sched.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s11)  # ninth session (issue 11), a fresh machine: the 16-stream step of 1.1b-Q8_0 on the tensor cores: serve_bench
  # local 1,16 with and without the warmup's runs (the first all-16 step built its CUDA graphs inside serving), the
  # worker split (sched_overhead --model: the child's own step beside the parent's), a serving-like 16-column step
  # taken apart (decode_profile --spread --ctx --cprofile), then the bare 16- and 1-column steps, time allowing
  { date -u; nproc; uptime; lscpu | grep "Model name"; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  export MESH_GPU_MV=${S11_MV-tc} DEV=CUDA
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  for w in 1 0 1; do  # the first compiles (~80 s on a fresh machine), the rest find tinygrad's disk cache
    l=$(lim 170); [ "$l" -gt 60 ] || { echo "skip serve_bench MESH_WARM_RUN=$w: no time"; continue; }
    echo "== serve_bench local 1,16, MESH_WARM_RUN=$w (limit ${l}s)"
    MESH_WARM_RUN=$w timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local 2>&1 \
      | grep -v Warning | tee -a "$OUT/serve.txt"
  done
  l=$(lim 120); echo "== sched_overhead worker 1,16 (limit ${l}s)"
  timeout $l python3 bench/sched_overhead.py --modes worker --model $M/$F.gguf --device CUDA --streams 1,16 --rounds 1 \
    --steps 300 --consumers plain 2>&1 | grep -v Warning | tee -a "$OUT/sched.txt"
  for args in "--batch 16 --steps 20 --pos 40 --spread 8 --ctx 512 --cprofile" "--batch 16 --steps 20" \
              "--batch 1 --steps 20 --pos 100 --ctx 512"; do
    l=$(lim 90); [ "$l" -gt 40 ] || { echo "skip decode_profile $args: no time"; continue; }
    echo "== decode_profile $args (limit ${l}s)"
    timeout $l python3 bench/decode_profile.py --model $M/$F.gguf $args 2>&1 | grep -v Warning | tee -a "$OUT/steps.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s13)  # eleventh session (issue 11): the tensor-core matvec at 16 columns is bound by instructions, and a warp's
  # x pieces (split in registers at 8+ columns) serve its R row tiles: R from MESH_GPU_TC_WARPS (changes no sum):
  # the engine's step first, then the bits on CUDA, then the matrices alone, then serve_bench ($S13_SERVE_AB) as time
  # allows (x split by a kernel of its own, MESH_GPU_TC_PRESPLIT, was measured here and removed: RESULTS)
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  for wp in ${S13_WARPS:-2048 512}; do
    l=$(lim 100); [ "$l" -gt 40 ] || { echo "skip decode_profile $wp: no time"; continue; }
    echo "== decode_profile 16 columns MESH_GPU_TC_WARPS=$wp (limit ${l}s)"
    MESH_GPU_MV=tc MESH_GPU_TC_WARPS=$wp DEV=CUDA timeout $l python3 bench/decode_profile.py \
      --model $M/$F.gguf --batch 16 --steps 20 --pos 40 --spread 8 --ctx 512 2>&1 | grep -v Warning | tee -a "$OUT/steps.txt"
  done
  l=$(lim 90); [ "$l" -gt 30 ] && { echo "== tests/test_matvec_tc.py -k split on CUDA (limit ${l}s)"
    DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_tc.py \
      -k split 2>&1 | grep -v "Warning\|warn" | tail -5 | tee "$OUT/pytest_cuda.txt"; }
  for run in ${S13_MV:-1.1b:16:Q8_0}; do
    IFS=: read -r shape n types <<< "$run"
    l=$(lim 170); [ "$l" -gt 60 ] || { echo "skip matvec_bench $run: no time"; continue; }
    echo "== matvec_bench --shape $shape --n $n --types $types --tc (limit ${l}s)"
    DEV=CUDA timeout $l python3 bench/matvec_bench.py --shape $shape --n $n --types $types --tc --reps 10 \
      --tc-layouts ${S13_LAYOUTS:-8:2048,8:512} 2>&1 | grep -v Warning > "$OUT/mv_${shape}_${n}_${types}.txt"
    sed -n '/^summary/,$p' "$OUT/mv_${shape}_${n}_${types}.txt" | tee -a "$OUT/matvec_tc.txt"
  done
  if [ -n "${S13_SERVE_AB:-}" ]; then  # serve_bench, this tree with and without it, one round each
    l=$(lim 300); [ "$l" -gt 120 ] && { echo "== serve_bench local 1,16 --ab-env $S13_SERVE_AB (limit ${l}s)"
      MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
        --rounds 1 --ab-env $S13_SERVE_AB 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"; }
  fi
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s13b)  # eleventh session (issue 11): 16 streams against one with and without $S13B_AB, rounds alternating in one command
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  l=$(lim 420); echo "== serve_bench local 1,16 --ab-env ${S13B_AB:-MESH_GPU_TC_WARPS=2048} (limit ${l}s)"
  MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
    --rounds ${S13B_ROUNDS:-2} --ab-env ${S13B_AB:-MESH_GPU_TC_WARPS=2048} 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  l=$(lim 150); [ "$l" -gt 40 ] && { echo "== tests/test_matvec_tc.py on CUDA (limit ${l}s)"
    DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_tc.py \
      2>&1 | grep -v "Warning\|warn" | tail -8 | tee "$OUT/pytest_cuda.txt"; }
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s13d)  # eleventh session (issue 11): where the 16-column step's GPU time goes beside the tensor-core matvecs: ncu's
  # kernel durations of $S13D_STEPS serving-like steps (ncu failed on the tc kernels in s12b: they are left out by
  # name and timed alone by matvec_bench in s13), summed per kernel kind, against the step's own time
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  for b in ${S13D_BATCH:-16 1}; do
    l=$(lim 200); [ "$l" -gt 50 ] || { echo "skip ncu batch $b: no time"; continue; }
    echo "== ncu, tc kernels left out: decode_profile --batch $b (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l $NCU --profile-from-start off --clock-control none --kernel-name 'regex:^(?!mvtc)' \
      --metrics gpu__time_duration.sum --csv python3 bench/decode_profile.py --model $M/$F.gguf --ncu \
      --steps ${S13D_STEPS:-3} --batch $b --pos 40 --spread $([ $b -gt 1 ] && echo 8 || echo 0) --ctx 512 > "$OUT/ncu_$b.csv" 2>&1
    grep -i "error" "$OUT/ncu_$b.csv" | head -5
    python3 bench/decode_profile.py --model x --summarize "$OUT/ncu_$b.csv" --steps ${S13D_STEPS:-3} 2>&1 | head -30 | tee -a "$OUT/profile.txt"
  done
  l=$(lim 100); [ "$l" -gt 40 ] && { echo "== decode_profile 16 columns (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/decode_profile.py --model $M/$F.gguf --batch 16 --steps 20 --pos 40 \
      --spread 8 --ctx 512 2>&1 | grep -v Warning | tee -a "$OUT/steps.txt"; }
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s12)  # tenth session (issues 11 and 10), a fresh machine: the lean CUDA graph against tinygrad's on 1.1b-Q8_0
  { date -u; nproc; uptime; lscpu | grep "Model name"; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  export MESH_GPU_MV=${S11_MV-tc} DEV=CUDA
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  l=$(lim 240); echo "== tests/test_cuda_graph.py (limit ${l}s)"
  timeout $l python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py 2>&1 | tail -15 | tee -a "$OUT/tests.txt"
  for args in "--batch 16 --steps 20 --pos 40 --spread 8 --ctx 512 --cprofile" "--batch 1 --steps 20 --pos 100 --ctx 512"; do
    for lean in 0 1; do
      l=$(lim 90); [ "$l" -gt 40 ] || { echo "skip decode_profile $args lean=$lean: no time"; continue; }
      echo "== decode_profile $args MESH_LEAN_GRAPH=$lean (limit ${l}s)"
      MESH_LEAN_GRAPH=$lean timeout $l python3 bench/decode_profile.py --model $M/$F.gguf $args 2>&1 | grep -v Warning \
        | tee -a "$OUT/steps.txt"
    done
  done
  for lean in ${S12_SERVE-1 0 1}; do
    l=$(lim 170); [ "$l" -gt 60 ] || { echo "skip serve_bench MESH_LEAN_GRAPH=$lean: no time"; continue; }
    echo "== serve_bench local 1,16, MESH_LEAN_GRAPH=$lean (limit ${l}s)"
    MESH_LEAN_GRAPH=$lean timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local 2>&1 \
      | grep -v Warning | tee -a "$OUT/serve.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s12b)  # tenth session: where a 16-column step's GPU time goes (ncu), then issue 10's chain on the 8B shape
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0 B8=8b-Q4_0
  ( [ -f $M/.$B8 ] || { nice python3 bench/synth_gguf.py $M/$B8.gguf --shape 8b --type Q4_0 > "$OUT/synth8b.txt" 2>&1 \
      && touch $M/.$B8; } ) &
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  for args in "--batch 16 --pos 40 --spread 8 --ctx 512" "--batch 1 --pos 100 --ctx 512" "--batch 8 --pos 40 --spread 16 --ctx 512"; do
    l=$(lim 120); [ "$l" -gt 40 ] || { echo "skip ncu $args: no time"; continue; }
    n=$(echo $args | tr -c 'a-z0-9' _)
    echo "== ncu $F $args (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
      --csv python3 bench/decode_profile.py --model $M/$F.gguf --ncu --steps 3 $args > "$OUT/ncu_$n.csv" 2>&1
    python3 bench/decode_profile.py --model x --summarize "$OUT/ncu_$n.csv" --steps 3 2>&1 | head -30 | tee -a "$OUT/profile.txt"
  done
  wait
  l=$(lim 300); [ "$l" -gt 120 ] || { echo "skip mesh_bench: no time"; exit 0; }
  echo "== mesh_bench $B8 1,3 peers, stage in the peer (limit ${l}s)"
  MESH_STAGE_IN_PEER=1 DEV=CUDA timeout $l python3 bench/mesh_bench.py --model $M/$B8.gguf --peers 1,3 --rounds 2 \
    --tokens 64 ${S12B_AB:+--ab $S12B_AB} 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s12c)  # tenth session: the fixed cost of a stage's step, tinygrad's graph against the lean one (bench/stage_ab.py)
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  for f in 8b-Q4_0 1.1b-Q8_0; do
    [ -f $M/.$f ] || { python3 bench/synth_gguf.py $M/$f.gguf --shape ${f%-*} --type ${f#*-} > "$OUT/synth_$f.txt" 2>&1; touch $M/.$f; }
  done
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  while read -r f args; do
    l=$(lim 150); [ "$l" -gt 45 ] || { echo "skip stage_ab $f $args: no time"; continue; }
    echo "== stage_ab $f $args (limit ${l}s)"
    env ${S12C_ENV:-} DEV=CUDA timeout $l python3 bench/stage_ab.py --model $M/$f.gguf $args 2>&1 | grep -v Warning \
      | tee -a "$OUT/stage_ab.txt"
  done <<EOF2
8b-Q4_0 --layers 11:22 --steps 100 --rounds 4 --profile
1.1b-Q8_0 --layers 0:22 --steps 100 --rounds 4
8b-Q4_0 --layers 0:11 --steps 100 --rounds 2
EOF2
  l=$(lim 150); [ "$l" -gt 45 ] && { echo "== stage_ab 1.1b-Q8_0 tc 16 columns (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/stage_ab.py --model $M/1.1b-Q8_0.gguf --layers 0:22 --batch 16 \
      --steps 50 --rounds 4 2>&1 | grep -v Warning | tee -a "$OUT/stage_ab.txt"; }
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s12d)  # tenth session (issue 10): the 8B chain's cost a stage, one process against three
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=8b-Q4_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 8b --type Q4_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  l=$(lim 150); echo "== engine_bench $F split 0,11,22,32 in one process (limit ${l}s)"
  DEV=CUDA timeout $l python3 bench/engine_bench.py --model $M/$F.gguf --synthetic-prompt 16 --tokens 64 --ctx 256 \
    --splits 0,11,22,32 --skip llama,memory,batch,engine,coldstart 2>&1 | grep -v Warning | tee -a "$OUT/split.txt"
  l=$(lim 330); [ "$l" -gt 120 ] || { echo "skip mesh_bench: no time"; exit 0; }
  echo "== mesh_bench $F 1,3 peers, --ab MESH_LEAN_GRAPH=0 (limit ${l}s)"
  DEV=CUDA timeout $l python3 bench/mesh_bench.py --model $M/$F.gguf --peers 1,3 --rounds 2 --tokens 64 \
    --ab MESH_LEAN_GRAPH=0 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s12e)  # tenth session (issue 10): the 8B chain with hot waits that poll without sleeping
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=8b-Q4_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 8b --type Q4_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  l=$(( $(left) - 10 )); echo "== mesh_bench $F 1,3 peers, --ab MESH_SPIN_US=${SPIN_US:-5000} (limit ${l}s)"
  DEV=CUDA timeout $l python3 bench/mesh_bench.py --model $M/$F.gguf --peers 1,3 --rounds ${ROUNDS:-2} --tokens 64 \
    --ab MESH_SPIN_US=${SPIN_US:-5000} 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s12f)  # tenth session, the last tree: the GPU's tests and 16 streams once more
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  l=$(lim 150); echo "== tests on CUDA (limit ${l}s)"
  DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py 2>&1 \
    | tail -15 | tee -a "$OUT/tests.txt"
  l=$(lim 170); [ "$l" -gt 60 ] && { echo "== serve_bench local 1,16 (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local 2>&1 \
      | grep -v Warning | tee -a "$OUT/serve.txt"; }
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s14)  # fifteenth session (issue 11): a warp's blocks taken U a loop step (MESH_GPU_TC_UNROLL: their loads issued
  # together; the same sums) and the split attention's chunks past a column's position not loaded (MESH_GPU_ATTN_SKIP):
  # bits on CUDA, the matrices alone at 16 and 1 columns for U = 1, 2, 4, ncu's full set on one 16-column matrix (what
  # bounds it), then decode_ab of U at 16 columns
  { date -u; nproc; uptime; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  l=$(lim 150); echo "== tests on CUDA: the unroll, the warps, a column alone, the split attention (limit ${l}s)"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_tc.py \
    -k "loop_step or warps or alone" tests/test_attention_gpu.py 2>&1 | grep -v "Warning\|warn" | tail -8 \
    | tee "$OUT/pytest_cuda.txt"
  for run in 16:8:512:1,8:512:2,8:512:4 1:8:2048:1,8:2048:2,8:2048:4; do
    n=${run%%:*}; lays=${run#*:}
    l=$(lim 150); [ "$l" -gt 60 ] || { echo "skip matvec_bench n=$n: no time"; continue; }
    echo "== matvec_bench --shape 1.1b --n $n --types Q8_0 --tc --tc-layouts $lays (limit ${l}s)"
    DEV=CUDA timeout $l python3 bench/matvec_bench.py --shape 1.1b --n $n --types Q8_0 --tc --reps 10 \
      --tc-layouts $lays 2>&1 | grep -v Warning > "$OUT/mv_$n.txt"
    sed -n '/^summary/,$p' "$OUT/mv_$n.txt" | tee -a "$OUT/matvec_tc.txt"
  done
  l=$(lim 120); [ "$l" -gt 50 ] && { echo "== ncu --set full, gate_up at 16 columns, U=1 (limit ${l}s)"
    JIT=0 DEV=CUDA timeout $l ncu --kernel-name regex:mvtc --launch-count 1 --set full python3 bench/matvec_bench.py \
      --shape 1.1b --n 16 --types Q8_0 --mats gate_up --tc --reps 1 --tc-layouts 8:512:1 > "$OUT/ncu_gate_up.txt" 2>&1
    grep -v "^==PROF==\|Warning" "$OUT/ncu_gate_up.txt" | sed -n '/mvtc/,$p' | head -150; }
  l=$(lim 200); [ "$l" -gt 80 ] && { echo "== decode_ab 16 columns at 128, U = 1, 2 (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/decode_ab.py --model $M/$F.gguf --batch 16 --positions 128 \
      --rounds 3 --steps 20 --greedy --variant u1=MESH_GPU_TC_UNROLL=1 --variant u2=MESH_GPU_TC_UNROLL=2 2>&1 \
      | grep -v Warning | tee -a "$OUT/ab.txt"; }
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s14b)  # fifteenth session (issue 11): serve_bench 1,16 with and without $S14B_AB (rounds alternating in one command),
  # then the serving-like 16-column step for MESH_GPU_ATTN_SKIP in $S14B_SKIPS, then the tc and attention tests on CUDA
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  l=$(lim 360); [ "$l" -gt 120 ] && { echo "== serve_bench local 1,16 --ab-env ${S14B_AB:-MESH_GPU_ATTN_SKIP=0} (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
      --rounds ${S14B_ROUNDS:-2} --ab-env ${S14B_AB:-MESH_GPU_ATTN_SKIP=0} 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"; }
  for sk in ${S14B_SKIPS:-0 1}; do
    l=$(lim 90); [ "$l" -gt 40 ] || { echo "skip decode_profile skip=$sk: no time"; continue; }
    echo "== decode_profile 16 columns spread 8, MESH_GPU_ATTN_SKIP=$sk (limit ${l}s)"
    MESH_GPU_ATTN_SKIP=$sk MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/decode_profile.py \
      --model $M/$F.gguf --batch 16 --steps 20 --pos 40 --spread 8 --ctx 512 2>&1 | grep -v Warning | tee -a "$OUT/steps.txt"
  done
  l=$(lim 150); [ "$l" -gt 40 ] && { echo "== tests on CUDA: tc matvec, split attention (limit ${l}s)"
    DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_tc.py \
      tests/test_attention_gpu.py 2>&1 | grep -v "Warning\|warn" | tail -8 | tee "$OUT/pytest_cuda.txt"; }
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s14c)  # fifteenth session (issue 11), after s14: the tc kernel's partials padded in shared memory (no bank conflicts),
  # the matrices alone at 16 and 1 columns for SPLIT:WARPS:UNROLL in $S14C_MV16 / $S14C_MV1, ncu of gate_up again,
  # decode_ab of $S14C_VARIANTS at 16 and at 1 column, the serving-like step with the attention's skip on and off
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  for run in 16:${S14C_MV16:-8:512:1,8:512:2,16:512:1} 1:${S14C_MV1:-8:2048:1,16:2048:1}; do
    n=${run%%:*}; lays=${run#*:}
    l=$(lim 120); [ "$l" -gt 60 ] || { echo "skip matvec_bench n=$n: no time"; continue; }
    echo "== matvec_bench --shape 1.1b --n $n --types Q8_0 --tc --tc-layouts $lays (limit ${l}s)"
    DEV=CUDA timeout $l python3 bench/matvec_bench.py --shape 1.1b --n $n --types Q8_0 --tc --reps 10 \
      --tc-layouts $lays 2>&1 | grep -v Warning > "$OUT/mv_$n.txt"
    sed -n '/^summary/,$p' "$OUT/mv_$n.txt" | grep tc | tee -a "$OUT/matvec_tc.txt"
  done
  l=$(lim 90); [ "$l" -gt 40 ] && { echo "== ncu --set full, gate_up at 16 columns, padded (limit ${l}s)"
    JIT=0 DEV=CUDA timeout $l ncu --kernel-name regex:mvtc --launch-count 1 --set full python3 bench/matvec_bench.py \
      --shape 1.1b --n 16 --types Q8_0 --mats gate_up --tc --reps 1 --tc-layouts 8:512:1 > "$OUT/ncu_gate_up.txt" 2>&1
    grep -i "duration\|bank\|eligible\|issue slots\|waves\|Registers Per\|Achieved Occ\|Theoretical Occ" "$OUT/ncu_gate_up.txt"; }
  V="${S14C_VARIANTS:-u1=MESH_GPU_TC_UNROLL=1 u2=MESH_GPU_TC_UNROLL=2 s16=MESH_GPU_TC_SPLIT=16 s16u2=MESH_GPU_TC_SPLIT=16;MESH_GPU_TC_UNROLL=2}"
  for b in 16 1; do
    l=$(lim 150); [ "$l" -gt 60 ] || { echo "skip decode_ab batch $b: no time"; continue; }
    echo "== decode_ab $b columns at 128: $V (limit ${l}s)"
    args=(); for v in $V; do args+=(--variant "$v"); done
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/decode_ab.py --model $M/$F.gguf --batch $b --positions 128 \
      --rounds 3 --steps 20 --greedy "${args[@]}" 2>&1 | grep -v Warning | tee -a "$OUT/ab.txt"
  done
  for sk in 1 0; do
    l=$(lim 90); [ "$l" -gt 40 ] || { echo "skip decode_profile skip=$sk: no time"; continue; }
    echo "== decode_profile 16 columns spread 8, MESH_GPU_ATTN_SKIP=$sk (limit ${l}s)"
    MESH_GPU_ATTN_SKIP=$sk MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/decode_profile.py \
      --model $M/$F.gguf --batch 16 --steps 20 --pos 40 --spread 8 --ctx 512 2>&1 | grep -v Warning | tee -a "$OUT/steps.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s14d)  # fifteenth session (issue 11), after s14c: decode_ab of the tc kernel's split (S), columns a thread block (GROUP)
  # and unroll (U) at 16 and 1 column on 1.1b-Q8_0 ($S14D_V16, $S14D_V1), then on 8b-Q4_0 ($S14D_V8B at 16 and 1)
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 1.1b --type Q8_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  ( [ -f $M/.8b-Q4_0 ] || { python3 bench/synth_gguf.py $M/8b-Q4_0.gguf --shape 8b --type Q4_0 > "$OUT/synth8.txt" 2>&1;
    touch $M/.8b-Q4_0; } ) &
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  ab() {  # ab <file> <batch> <limit> <variants...>
    local f=$1 b=$2 l; l=$(lim $3); shift 3
    [ "$l" -gt 60 ] || { echo "skip decode_ab $f batch $b: no time"; return; }
    echo "== decode_ab $f $b columns at 128: $* (limit ${l}s)"
    local args=(); for v in "$@"; do args+=(--variant "$v"); done
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/decode_ab.py --model $M/$f.gguf --batch $b --positions 128 \
      --rounds 3 --steps 20 --greedy "${args[@]}" 2>&1 | grep -v Warning | tee -a "$OUT/ab.txt"
  }
  ab $F 16 130 ${S14D_V16:-base= s16=MESH_GPU_TC_SPLIT=16 g8=MESH_GPU_TC_GROUP=8 g8u2=MESH_GPU_TC_GROUP=8;MESH_GPU_TC_UNROLL=2 s16g8=MESH_GPU_TC_SPLIT=16;MESH_GPU_TC_GROUP=8}
  ab $F 1 110 ${S14D_V1:-base= u2=MESH_GPU_TC_UNROLL=2 s16=MESH_GPU_TC_SPLIT=16 s16u2=MESH_GPU_TC_SPLIT=16;MESH_GPU_TC_UNROLL=2}
  wait
  for b in 16 1; do
    ab 8b-Q4_0 $b 150 ${S14D_V8B:-base= s16=MESH_GPU_TC_SPLIT=16 g8=MESH_GPU_TC_GROUP=8 u2=MESH_GPU_TC_UNROLL=2}
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s16)  # sixteenth session (issue 11): the tensor-core matvec with x in 8 bits (engine/matvec_gpu_s8.py): bits and
  # error on CUDA, the 1.1B matrices alone at 16 and 1 columns (bf16 tc and s8 on the same weights), then decode_ab of
  # the s8 stage against the bf16 one at 16 and 1 column (greedy ids of each variant printed)
  { date -u; nproc; uptime; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  synth_once $F 1.1b Q8_0
  l=$(lim 120); echo "== tests on CUDA: tests/test_matvec_s8.py (limit ${l}s)"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_matvec_s8.py \
    2>&1 | grep -v "Warning\|warn" | tail -12 | tee "$OUT/pytest_cuda.txt"
  for run in 16:${S16_MV16:-8:512:2,8:2048:2} 1:${S16_MV1:-8:2048:2}; do
    n=${run%%:*}; lays=${run#*:}
    l=$(lim 100); [ "$l" -gt 50 ] || { echo "skip matvec_bench n=$n: no time"; continue; }
    echo "== matvec_bench --shape 1.1b --n $n --types Q8_0 --tc --x8 --tc-layouts $lays (limit ${l}s)"
    DEV=CUDA timeout $l python3 bench/matvec_bench.py --shape 1.1b --n $n --types Q8_0 --tc --x8 --reps 10 \
      --tc-layouts $lays 2>&1 | grep -v Warning > "$OUT/mv_$n.txt"
    sed -n '/^summary/,$p' "$OUT/mv_$n.txt" | grep "tc\|s8" | tee -a "$OUT/matvec.txt"
  done
  for b in 16 1; do tc_ab $F $b 130 ${S16_VARIANTS:-bf16= x8=MESH_GPU_TC_X8=1 x8w=MESH_GPU_TC_X8=1;MESH_GPU_TC_WARPS=2048}; done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s16b)  # sixteenth session (issue 11), after s16 (the quantize kernel a thread a block, s8 at WARPS every width): the s8
  # tests on CUDA (with a serving stage of Q4_0 and of Q8_0; the failing one names its contract), decode_ab of the
  # 1.1B step at 16 and 1 column, serve_bench 1,16 on 1.1b-Q8_0 with and without MESH_GPU_TC_X8=1, then the 8B Q4_0
  # step if time is left
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  synth_once $F 1.1b Q8_0
  # S16B_8B=1: the 8B file too, written beside the rest (niced)
  [ "${S16B_8B:-0}" = 1 ] && ( renice -n 10 $BASHPID > /dev/null; synth_once 8b-Q4_0 8b Q4_0 synth8.txt ) &
  l=$(lim 120); echo "== tests on CUDA: tests/test_matvec_s8.py (limit ${l}s)"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore -rf \
    tests/test_matvec_s8.py 2>&1 | grep -v "Warning\|warn" | grep "passed\|failed\|FAILED\|Error\|Mismatch\|index\|diff" \
    | tail -20 | tee "$OUT/pytest_cuda.txt"
  for b in 16 1; do tc_ab $F $b 100 bf16= x8=MESH_GPU_TC_X8=1; done
  l=$(lim 230); [ "$l" -gt 120 ] && { echo "== serve_bench local 1,16 --ab-env MESH_GPU_TC_X8=1 (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
      --rounds ${S16B_ROUNDS:-1} --ab-env MESH_GPU_TC_X8=1 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"; }
  wait
  for b in 16 1; do
    [ -f $M/.8b-Q4_0 ] || { echo "skip decode_ab 8b: the file is not written (S16B_8B=1 writes it)"; break; }
    tc_ab 8b-Q4_0 $b 100 bf16= x8=MESH_GPU_TC_X8=1
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s17)  # seventeenth session (issue 11), a fresh machine: where the Q8_0 serving stage's s8 bits part (bench/s8_bisect.py:
  # every s8 matmul's x, q, d and result, a sequence alone against beside another), the serving tests on CUDA, and
  # the 8B Q4_0 step bf16 against s8 (decode_ab at 16 and 1 column; the file written in the background meanwhile)
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  ( renice -n 10 $BASHPID > /dev/null; synth_once 8b-Q4_0 8b Q4_0 synth8.txt ) &
  for q in Q8_0 Q4_0; do
    l=$(lim 150); echo "== s8_bisect $q (limit ${l}s)"
    DEV=CUDA timeout $l python3 bench/s8_bisect.py --qtype $q --steps 2 2>&1 | grep -v Warning | tee "$OUT/bisect_$q.txt" \
      | grep -v " equal$" | tail -40
  done
  l=$(lim 120); echo "== tests on CUDA: serving stage (limit ${l}s)"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore -rf \
    tests/test_matvec_s8.py -k serving 2>&1 | grep -v "Warning\|warn" | tail -30 | tee "$OUT/pytest_cuda.txt"
  wait
  for b in 16 1; do tc_ab 8b-Q4_0 $b 110 bf16= x8=MESH_GPU_TC_X8=1; done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s17b)  # a fresh machine, after the renderer's fix and with 8-bit x the tc stages' default: the tc, s8 and CUDA-graph
  # tests on CUDA, serve_bench 1,16 on 1.1b-Q8_0 (default against MESH_GPU_TC_X8=0, rounds alternating), then on the
  # 8B Q4_0 file (written in the background meanwhile)
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  synth_once $F 1.1b Q8_0
  ( renice -n 10 $BASHPID > /dev/null; synth_once 8b-Q4_0 8b Q4_0 synth8.txt ) &
  l=$(lim 150); echo "== tests on CUDA: s8, tc, cuda graph (limit ${l}s)"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore -rf \
    tests/test_matvec_s8.py tests/test_matvec_tc.py tests/test_cuda_graph.py 2>&1 | grep -v "Warning\|warn" | tail -25 \
    | tee "$OUT/pytest_cuda.txt"
  l=$(lim 230); echo "== serve_bench $F local 1,16 --ab-env MESH_GPU_TC_X8=0 (limit ${l}s)"
  MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
    --rounds ${S17B_ROUNDS:-1} --ab-env MESH_GPU_TC_X8=0 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  wait
  l=$(lim 200); [ "$l" -gt 100 ] && { echo "== serve_bench 8b-Q4_0 local 1,16 --ab-env MESH_GPU_TC_X8=0 (limit ${l}s)"
    MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/8b-Q4_0.gguf --streams 1,16 --modes local \
      --rounds 1 --ab-env MESH_GPU_TC_X8=0 2>&1 | grep -v Warning | tee -a "$OUT/serve8.txt"; }
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s17c)  # a fresh machine: the serving-stage tests on CUDA (tc and s8), then serve_bench 1,16 on 1.1b-Q8_0 with 8-bit x
  # (the default) against MESH_GPU_TC_X8=0, one round of each with room for both
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  F=1.1b-Q8_0
  synth_once $F 1.1b Q8_0
  l=$(lim 100); echo "== tests on CUDA: serving stages and the renderer (limit ${l}s)"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -q -p no:cacheprovider -W ignore -rf \
    tests/test_matvec_s8.py tests/test_matvec_tc.py -k "serving or grouping" 2>&1 | tail -8 | tee "$OUT/pytest_cuda.txt"
  l=$(lim 400); echo "== serve_bench $F local 1,16 --ab-env MESH_GPU_TC_X8=0 (limit ${l}s)"
  MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/$F.gguf --streams 1,16 --modes local \
    --rounds 1 --ab-env MESH_GPU_TC_X8=0 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s17d)  # a fresh machine: serve_bench 1,16 on the 8B Q4_0 file with the defaults (8-bit x on the tensor cores); the
  # bf16 figure is s17b's
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  synth_once 8b-Q4_0 8b Q4_0 synth8.txt
  l=$(lim 400); echo "== serve_bench 8b-Q4_0 local 1,16 (limit ${l}s)"
  MESH_GPU_MV=tc DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/8b-Q4_0.gguf --streams 1,16 --modes local \
    --rounds 1 2>&1 | grep -v Warning | tee -a "$OUT/serve8.txt"
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s17e)  # a fresh machine, the session's last tree: s8_bisect (every call equal), then the s8, tc and CUDA-graph tests
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  l=$(lim 45); echo "== s8_bisect Q8_0 (limit ${l}s)"
  DEV=CUDA timeout $l python3 bench/s8_bisect.py --qtype Q8_0 --steps 2 2>&1 | grep -v Warning > "$OUT/bisect.txt"
  grep -c " equal$" "$OUT/bisect.txt"; grep -v " equal$" "$OUT/bisect.txt" | tail -5
  l=$(lim 150); echo "== tests on CUDA (limit ${l}s)"
  DEV=CUDA MESH_GPU_TEST_DEV=CUDA timeout $l python3 -m pytest -p no:cacheprovider -W ignore -rf \
    tests/test_matvec_s8.py tests/test_matvec_tc.py tests/test_cuda_graph.py 2>&1 | tail -6 | tee "$OUT/pytest_cuda.txt"
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s18)  # eighteenth session (issues 10, 11): the pump's pass (mesh/link.py) on the GPU chain: the 8B Q4_0 3-peer chain with
  # the hot sink and without (mesh_bench --ab MESH_HOT_SINK=0), then serve_bench's chain rows on 1.1B Q8_0
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  synth_once 8b-Q4_0 8b Q4_0 synth8.txt
  synth_once 1.1b-Q8_0 1.1b Q8_0 synth1.txt
  l=$(lim 330); echo "== mesh_bench 8b-Q4_0 1,3 peers --ab MESH_HOT_SINK=0 (limit ${l}s)"
  DEV=CUDA timeout $l python3 bench/mesh_bench.py --model $M/8b-Q4_0.gguf --peers 1,3 --rounds 2 --tokens 64 \
    --ab MESH_HOT_SINK=0 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  l=$(lim 200); echo "== serve_bench 1.1b-Q8_0 chain 1,4,16 (limit ${l}s)"
  DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/1.1b-Q8_0.gguf --streams 1,4,16 --modes chain \
    --rounds 1 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s19)  # nineteenth session (issues 10, 11): the hot sink on the GPU chain settled by an A/A run first (both fleets with
  # it: what the order alone gives the second fleet), then the A/B again; serve_bench local 1,16 on 1.1B Q8_0
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  synth_once 8b-Q4_0 8b Q4_0 synth8.txt
  synth_once 1.1b-Q8_0 1.1b Q8_0 synth1.txt
  for ab in MESH_HOT_SINK=1 MESH_HOT_SINK=0; do
    l=$(lim 300); [ "$l" -gt 120 ] || { echo "skip mesh_bench --ab $ab: no time"; continue; }
    echo "== mesh_bench 8b-Q4_0 1,3 peers --ab $ab (limit ${l}s)"
    DEV=CUDA timeout $l python3 bench/mesh_bench.py --model $M/8b-Q4_0.gguf --peers 3 --rounds 3 --tokens 64 \
      --ab $ab 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  done
  l=$(lim 200); echo "== serve_bench 1.1b-Q8_0 local 1,16 (limit ${l}s)"
  DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/1.1b-Q8_0.gguf --streams 1,16 --modes local \
    --rounds 1 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s20)  # twentieth session (issue 11's closing figures): serve_bench's whole table on the final tree, both modes in one
  # run (the chain: 3 stages in CUDA workers on the one GPU), then the 8B 3-peer chain once more if time is left
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  synth_once 1.1b-Q8_0 1.1b Q8_0 synth1.txt
  l=$(lim 420); echo "== serve_bench 1.1b-Q8_0 local,chain 1,4,8,16 (limit ${l}s)"
  DEV=CUDA timeout $l python3 bench/serve_bench.py --model $M/1.1b-Q8_0.gguf --streams 1,4,8,16 --modes local,chain \
    --rounds 1 2>&1 | grep -v Warning | tee -a "$OUT/serve.txt"
  l=$(lim 200)
  if [ "$l" -gt 150 ]; then
    synth_once 8b-Q4_0 8b Q4_0 synth8.txt
    l=$(lim 200); echo "== mesh_bench 8b-Q4_0 1,3 peers (limit ${l}s)"
    DEV=CUDA timeout $l python3 bench/mesh_bench.py --model $M/8b-Q4_0.gguf --peers 1,3 --rounds 2 --tokens 64 2>&1 \
      | grep -v Warning | tee -a "$OUT/mesh.txt"
  else echo "skip mesh_bench: no time"; fi
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s20b)  # twentieth session (issue 10): the writer's yield after a hop's frame (common/handoff.py) on the GPU host: one
  # hop alone (bench/hop_bench.py), then the 8B 3-peer chain with and without it, each order once (the second fleet
  # of an --ab run has come out ahead by 0.01-0.015 in A/A runs)
  { date -u; nproc; uptime; } 2>&1 | tee "$OUT/env.txt"
  timeout 120 python3 bench/hop_bench.py --rounds 3 --messages 1000 2>&1 | tee "$OUT/hop.txt"
  synth_once 8b-Q4_0 8b Q4_0 synth8.txt
  for order in "1 0" "0 1"; do
    set -- $order
    l=$(lim 220); [ "$l" -gt 120 ] || { echo "skip mesh_bench yield $1/$2: no time"; continue; }
    echo "== mesh_bench 8b-Q4_0 3 peers, MESH_WRITE_YIELD=$1 then --ab MESH_WRITE_YIELD=$2 (limit ${l}s)"
    MESH_WRITE_YIELD=$1 DEV=CUDA timeout $l python3 bench/mesh_bench.py --model $M/8b-Q4_0.gguf --peers 3 --rounds 3 \
      --tokens 64 --ab MESH_WRITE_YIELD=$2 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
s15)  # issue 10 on a 4-GPU host (run's nvidia-h200-x4): the 8B Q4_0 chain with every peer on a GPU of its own
  # (mesh_bench --gpus 1,2,3; the unsharded engine on GPU 0), then the same with all peers on one GPU, as before
  { date -u; nproc; uptime; nvidia-smi -L; } 2>&1 | tee "$OUT/env.txt"
  F=8b-Q4_0
  [ -f $M/.$F ] || { python3 bench/synth_gguf.py $M/$F.gguf --shape 8b --type Q4_0 > "$OUT/synth.txt" 2>&1; touch $M/.$F; }
  lim() { local l=$(( $(left) - 10 )); [ "$l" -gt "$1" ] && l=$1; echo $l; }
  for g in ${S15_GPUS:-1,2,3 none}; do
    l=$(lim 280); [ "$l" -gt 120 ] || { echo "skip mesh_bench gpus $g: no time"; continue; }
    echo "== mesh_bench $F 1,3 peers, gpus $g (limit ${l}s)"
    DEV=CUDA timeout $l python3 bench/mesh_bench.py --model $M/$F.gguf --peers 1,3 --rounds ${ROUNDS:-2} --tokens 64 \
      $([ "$g" = none ] || echo --gpus $g) 2>&1 | grep -v Warning | tee -a "$OUT/mesh.txt"
  done
  uptime; echo "elapsed $(( $(date +%s) - T0 )) s"
  ;;
esac
