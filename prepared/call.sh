#!/usr/bin/env bash
# The GPU call that measures the prepared patches (README.md here), in one command, ordered by what
# decides most, each step under its own timeout: a call cut short still brings back the first
# answers in $OUT (dw1.txt, bits.txt, kernels.txt, timers.txt, gswiglu.txt, bench.tgz, log: seven
# files).
#
#   prepared/call.sh build          here, before the call: the seven wheel folders under .whl/
#                                   (each from a clean checkout of main with the patches applied;
#                                   ~3-4 min each on two cores; a Python 3.12 with scikit-build-core,
#                                   pybind11, cmake and ninja: $MOK_WHEEL_PYTHON)
#   prepared/call.sh [STEP ...]     on the GPU machine (device `run`, carry [".whl"]): the steps
#                                   named (g, 1 .. 6 below; gt: g's times and bits alone), or
#                                   g and 1 .. 6 in that order; then
#   prepared/call.sh summary [DIR]  the bits per case and build, the tests' lines (DIR: default $OUT)
#
# Folders: mok-base (main), mok (dw1-transposed-epilogue), mok-x (epilogue + gather-x-lane),
# mok-f (epilogue + dw1-transposed-fp32), mok-pp (megakernel-pingpong-down), mok-g
# (g-swiglu-pingpong), mok-gp (g-swiglu-pingpong + g-swiglu-pairs).
set -o pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = build ]; then
  py=${MOK_WHEEL_PYTHON:-python3.12}
  e=prepared/dw1-transposed-epilogue.patch
  while read -r out patches; do
    args=()
    for p in $patches; do args+=(--patch "$p"); done
    python3 tools/gpu_wheels.py build --python "$py" --base main "${args[@]}" --out ".whl/$out" || exit 1
  done <<LIST
mok-base
mok $e
mok-x $e prepared/gather-x-lane.patch
mok-f $e prepared/dw1-transposed-fp32.patch
mok-pp prepared/megakernel-pingpong-down.patch
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
dw1() { echo "## $1" >>"$OUT/dw1.txt"; timeout 120 python3 $P/dwd_gather.py "${@:2}" >>"$OUT/dw1.txt" 2>&1; }
bits() { echo "## $1" >>"$OUT/bits.txt"; timeout 60 python3 $P/bits_digest.py >>"$OUT/bits.txt" 2>&1; }
bench() {
  wheels "$1"
  mark bench "$1" "$2"
  timeout 150 mok bench --shapes sonic-7b,qwen3-30b-a3b --providers mok --no-plot --out "/tmp/b/$1-$2" \
    >"/tmp/b/$1-$2.txt" 2>&1
  tar czf "$OUT/bench.tgz" -C /tmp b
}
mkdir -p /tmp/b
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
step_1() {  # The turned-over dW1's deferred epilogue against main: its times, its tests.
  wheels mok; mark dw1 mok; dw1 "mok bf16" sonic-7b qwen3-30b-a3b --dw1
  mark tests mok; tests reference 150 $BACKWARD
  wheels mok-base; mark dw1 base; dw1 "base bf16" sonic-7b qwen3-30b-a3b --dw1; bits base
}
step_2() {  # The lane (the forward stores no routed x, dW1 gathers it): tests, bits, a bench round.
  wheels mok-x; mark lane tests; tests cuda 180 tests/bf16/test_megakernel.py tests/layer/test_determinism.py
  bits mok-x
  bench mok-base 1; bench mok-x 1
}
step_3() {  # The g GEMM with dy in table order (no gather), main's build, against the gathered one.
  wheels mok-base; mark kernels
  timeout 90 python3 $P/experts_kernels.py 1536 256 128 196608 2048 768 128 65536 >"$OUT/kernels.txt" 2>&1
}
step_4() {  # fp32 weight gradients: the epilogue alone, main, the fp32 form (and its tests).
  wheels mok; mark fp32; dw1 "mok fp32" sonic-7b --dw1 --fp32
  wheels mok-base; dw1 "base fp32" sonic-7b --dw1 --fp32
  wheels mok-f; dw1 "mok-f fp32" sonic-7b --dw1 --fp32; mark tests mok-f
  tests reference 150 tests/bf16/test_bf16_grouped_backward.py
}
step_5() {  # Ping-pong down tasks: the megakernel's tests, its bits, its timers against main's.
  wheels mok-pp; mark pp tests; tests cuda 150 tests/bf16/test_megakernel.py; bits mok-pp
  for b in mok-pp mok-base; do
    wheels $b; mark timers $b; echo "## $b" >>"$OUT/timers.txt"
    timeout 90 python3 $P/megakernel_timers.py sonic-7b qwen3-30b-a3b >>"$OUT/timers.txt" 2>&1
  done
}
step_6() { bench mok-base 2; bench mok-x 2; }  # the second bench round
for step in "${@:-g 1 2 3 4 5 6}"; do
  for s in $step; do "step_$s"; done
done
mark done
