#!/usr/bin/env bash
# The GPU call that measures the prepared patches (README.md here), in one command, ordered by what
# decides most, each step under its own timeout: a call cut short still brings back the first
# answers in $OUT (gswiglu.txt, bits.txt, sass-mok-gc.csv.gz, ncu-mok-gc.txt, ncu-forward.txt,
# sass-forward.csv.gz, log).
#
#   prepared/call.sh build          here, before the call: the six wheel folders under .whl/
#                                   (each from a clean checkout of main with the patches applied;
#                                   ~1.5 min each on two cores; a Python 3.12 with scikit-build-core,
#                                   pybind11, cmake, ninja and setuptools: $MOK_WHEEL_PYTHON)
#   prepared/call.sh [STEP ...]     on the GPU machine (device `run`, carry [".whl"]): the steps
#                                   named (ga, sass, fwd below; gt: ga's times and bits alone),
#                                   or ga, sass and fwd in that order; then
#   prepared/call.sh summary [DIR]  the bits per case and build, the tests' lines (DIR: default $OUT)
#
# Folders: mok-base (main), mok-gs (the fused g kernel: g-swiglu-pingpong, -pairs and
# -shared-sigmoid), mok-ga (the same and g-swiglu-async-ab), mok-gb (mok-ga's and
# g-swiglu-batched-lookups), mok-gc (mok-ga's and g-swiglu-overlapping-epilogues), mok-gbc (both).
# Session 49 measured the others.
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
mok-gs prepared/g-swiglu-pingpong.patch prepared/g-swiglu-pairs.patch prepared/g-swiglu-shared-sigmoid.patch
mok-ga prepared/g-swiglu-pingpong.patch prepared/g-swiglu-pairs.patch prepared/g-swiglu-shared-sigmoid.patch prepared/g-swiglu-async-ab.patch
mok-gb prepared/g-swiglu-pingpong.patch prepared/g-swiglu-pairs.patch prepared/g-swiglu-shared-sigmoid.patch prepared/g-swiglu-async-ab.patch prepared/g-swiglu-batched-lookups.patch
mok-gc prepared/g-swiglu-pingpong.patch prepared/g-swiglu-pairs.patch prepared/g-swiglu-shared-sigmoid.patch prepared/g-swiglu-async-ab.patch prepared/g-swiglu-overlapping-epilogues.patch
mok-gbc prepared/g-swiglu-pingpong.patch prepared/g-swiglu-pairs.patch prepared/g-swiglu-shared-sigmoid.patch prepared/g-swiglu-async-ab.patch prepared/g-swiglu-overlapping-epilogues.patch prepared/g-swiglu-batched-lookups.patch
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
bits() { echo "## $1" >>"$OUT/bits.txt"; timeout 60 python3 $P/bits_digest.py >>"$OUT/bits.txt" 2>&1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv >>"$L"
echo "## committed-dw1" >>"$OUT/bits.txt"
cat benchmarks/results/profiles/2026-12-07_nvidia-h100_bits-digest-dw1.txt >>"$OUT/bits.txt"
BACKWARD="tests/bf16/test_bf16_grouped_backward.py tests/bf16/test_moe_backward_call.py"
step_gt() {  # The fused g kernel with a and b by cp.async (mok-ga), with its lookups batched too
  # (mok-gb) or its epilogues overlapping (mok-gc) or both (mok-gbc), without any (mok-gs) and
  # main's two kernels, in turns, then the bits.
  for b in mok-gbc mok-gc mok-ga mok-gb mok-gs mok-base mok-gs mok-gb mok-ga mok-gc mok-gbc; do
    wheels $b; mark g times $b; echo "## $b" >>"$OUT/gswiglu.txt"
    timeout 100 python3 $P/dwd_gather.py sonic-7b qwen3-30b-a3b >>"$OUT/gswiglu.txt" 2>&1
  done
  for b in mok-base mok-ga mok-gb mok-gc mok-gbc; do wheels $b; bits $b; done
}
g_tests() {  # g_tests BUILD: the backward's tests on the reference backend under BUILD's wheels,
  # the ping-pong patch's tests applied for the run
  wheels "$1"; mark g tests "$1"
  git apply --include='tests/*' prepared/g-swiglu-pingpong.patch >>"$L" 2>&1 || echo "the tests did not apply" >>"$L"
  tests reference 150 $BACKWARD
  git apply -R --include='tests/*' prepared/g-swiglu-pingpong.patch >>"$L" 2>&1 || echo "the tests did not come off" >>"$L"
}
step_ga() {  # ... then the backward's tests under mok-ga and mok-gc, and under mok-gc (its epilogues
  # overlap: the riskier synchronization) the layer's determinism on the cuda backend and the
  # sanitizers over the backward (its kernel is named for their GEMM filter; clusters of two).
  step_gt
  g_tests mok-ga
  g_tests mok-gc
  mark gc layer tests; tests cuda 150 tests/layer/test_determinism.py
  mark gc sanitizers; tests cuda 240 tests/bf16/test_megakernel.py -k "sanitizer and True"
}
step_sass() {  # ncu on mok-gc's g kernel at sonic-7b: the sections and each SASS instruction's
  # stall samples (session 49's split: the epilogue, the stage and turn waits), gzipped CSV
  wheels mok-gc; mark sass
  timeout 150 ncu --clock-control none --kernel-name regex:g_swiglu_gemm --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --import-source no -f -o /tmp/ga python3 $P/dwd_gather.py sonic-7b --ncu >"$OUT/ncu-mok-gc.txt" 2>&1
  echo "rc=$? ncu mok-gc" >>"$L"
  ncu -i /tmp/ga.ncu-rep --print-summary none >>"$OUT/ncu-mok-gc.txt" 2>&1
  ncu -i /tmp/ga.ncu-rep --page source --csv --print-source sass 2>>"$L" | gzip >"$OUT/sass-mok-gc.csv.gz"
}
step_fwd() {  # ncu on main's forward megakernel at sonic-7b: its sections and per-instruction
  # stall table (NOTES.md, session 49, item 2: is its gate/up feed bound by the L2's bytes?)
  wheels mok-base; mark fwd
  timeout 150 ncu --clock-control none --kernel-name regex:moe_forward --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section SourceCounters --import-source no -f -o /tmp/fwd python3 $P/megakernel_ncu.py sonic-7b \
    >"$OUT/ncu-forward.txt" 2>&1
  echo "rc=$? ncu forward" >>"$L"
  ncu -i /tmp/fwd.ncu-rep --print-summary none >>"$OUT/ncu-forward.txt" 2>&1
  ncu -i /tmp/fwd.ncu-rep --page source --csv --print-source sass 2>>"$L" | gzip >"$OUT/sass-forward.csv.gz"
}
for step in "${@:-ga sass fwd}"; do
  for s in $step; do "step_$s"; done
done
mark done
