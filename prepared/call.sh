#!/usr/bin/env bash
# The GPU call that measures the prepared patches (README.md here), in one command, ordered by what
# decides most, each step under its own timeout: a call cut short still brings back the first
# answers in $OUT (gswiglu.txt, bits.txt, ncu-mok-g.txt, ncu-mok-gp.txt, ncu-mok-base.txt,
# kernels.txt, log: seven files).
#
#   prepared/call.sh build          here, before the call: the three wheel folders under .whl/
#                                   (each from a clean checkout of main with the patches applied;
#                                   ~1.5 min each on two cores; a Python 3.12 with scikit-build-core,
#                                   pybind11, cmake and ninja: $MOK_WHEEL_PYTHON)
#   prepared/call.sh [STEP ...]     on the GPU machine (device `run`, carry [".whl"]): the steps
#                                   named (g, ncu, 3 below; gt: g's times and bits alone), or
#                                   g, ncu and 3 in that order; then
#   prepared/call.sh summary [DIR]  the bits per case and build, the tests' lines (DIR: default $OUT)
#
# Folders: mok-base (main), mok-g (g-swiglu-pingpong), mok-gp (g-swiglu-pingpong + g-swiglu-pairs).
# (Session 49 measured and merged or dropped the others: prepared/README.md.)
set -o pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = build ]; then
  py=${MOK_WHEEL_PYTHON:-python3.12}
  while read -r out patches; do
    args=()
    for p in $patches; do args+=(--patch "$p"); done
    python3 tools/gpu_wheels.py build --python "$py" --base main "${args[@]}" --out ".whl/$out" || exit 1
  done <<LIST
mok-base
mok-g prepared/g-swiglu-pingpong.patch
mok-gp prepared/g-swiglu-pingpong.patch prepared/g-swiglu-pairs.patch
LIST
  exit 0
fi
if [ "${1:-}" = summary ]; then
  dir=${2:-$OUT}
  python3 - "$dir/bits.txt" <<'PY'
import collections, sys
build, seen = None, collections.defaultdict(dict)
for line in open(sys.argv[1]):
    if line.startswith("## "):
        build = line[3:].strip()
        continue
    parts = line.split()
    if len(parts) >= 2 and len(parts[-1]) == 64:
        seen[parts[0]][build] = parts[-1][:10]
for case, digests in seen.items():
    print(case, "SAME" if len(set(digests.values())) == 1 else "DIFFER", digests)
PY
  grep -E "^rc=|passed|failed" "$dir/log" | tail -12
  exit 0
fi

: "${OUT:?run on the GPU machine, where the device tool sets OUT}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/log
P=benchmarks/probes
wheels() {
  echo "--- wheels $1" >>"$L"
  python3 -m pip install -q --no-index --no-deps --force-reinstall .whl/"$1"/*.whl 2>&1 | grep -vi warning >>"$L"
}
mark() { echo "=== [$SECONDS s] $*" | tee -a "$L"; }
tests() {  # tests BACKEND SECONDS FILE...
  MOK_TEST_DEVICE=cuda MOK_TEST_BACKEND=$1 timeout "$2" python3 -m pytest -q -x -p no:cacheprovider "${@:3}" \
    >/tmp/tests.txt 2>&1
  echo "rc=$? $1 ${*:3}" >>"$L"
  tail -4 /tmp/tests.txt >>"$L"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv >>"$L"
echo "## committed-dw1" >>"$OUT/bits.txt"
cat benchmarks/results/profiles/2026-12-07_nvidia-h100_bits-digest-dw1.txt >>"$OUT/bits.txt"
BACKWARD="tests/bf16/test_bf16_grouped_backward.py tests/bf16/test_moe_backward_call.py"
step_gt() {  # The g GEMM with the SwiGLU backward in ping-pong, alone and in pairs sharing B: its
  # times against main's, in turns, then the bits of each build.
  for b in mok-g mok-gp mok-base mok-gp mok-g; do
    wheels $b; mark g times $b; echo "## $b" >>"$OUT/gswiglu.txt"
    timeout 100 python3 $P/dwd_gather.py sonic-7b qwen3-30b-a3b >>"$OUT/gswiglu.txt" 2>&1
  done
  for b in mok-base mok-g mok-gp; do wheels $b; bits $b; done
}
g_tests() {  # g_tests BUILD PATCH...: the backward's tests on the reference backend under BUILD's
  # wheels, the patches' tests applied for the run
  wheels "$1"; mark g tests "$1"
  git apply --include='tests/*' "${@:2}" >>"$L" 2>&1 || echo "the patches' tests did not apply" >>"$L"
  tests reference 150 $BACKWARD
  git apply -R --include='tests/*' "${@:2}" >>"$L" 2>&1 || echo "the patches' tests did not come off" >>"$L"
}
step_g() {  # ... then the tests: the backward's under each build, the layer's determinism on the
  # cuda backend and the sanitizers over the backward (its kernel is named for their GEMM filter)
  # under the pairs' build, whose kernel runs clusters (the tests' one-SM cases the kernel alone).
  local g=prepared/g-swiglu-pingpong.patch
  step_gt
  g_tests mok-g $g
  g_tests mok-gp $g prepared/g-swiglu-pairs.patch
  mark g layer tests; tests cuda 150 tests/layer/test_determinism.py
  mark g sanitizers; tests cuda 240 tests/bf16/test_megakernel.py -k "sanitizer and True"
}
step_3() {  # The g GEMM with dy in table order (no gather), main's build, against the gathered one.
  wheels mok-base; mark kernels
  timeout 90 python3 $P/experts_kernels.py 1536 256 128 196608 2048 768 128 65536 >"$OUT/kernels.txt" 2>&1
}
step_ncu() {  # ncu on the g kernel (ping-pong, pairs) and main's SwiGLU backward kernel at sonic-7b:
  # where the fused kernel's time goes (stall reasons, L1 and L2 traffic, the top stall sites)
  local s="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
  s="$s --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section LaunchStats"
  s="$s --section Occupancy --section SourceCounters"
  for b in mok-g mok-gp mok-base; do
    local k=g_swiglu_gemm
    [ $b = mok-base ] && k=swiglu_backward
    wheels $b; mark ncu $b
    timeout 200 ncu --clock-control none --kernel-name regex:$k --launch-skip 1 --launch-count 1 $s \
      python3 $P/dwd_gather.py sonic-7b --ncu >"$OUT/ncu-$b.txt" 2>&1
    echo "rc=$? ncu $b" >>"$L"
  done
}
for step in "${@:-g ncu 3}"; do
  for s in $step; do "step_$s"; done
done
mark done
