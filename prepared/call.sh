#!/usr/bin/env bash
# The GPU call that measures what this folder prepares (README.md here), in one command, ordered by
# what decides most, each step under its own timeout: a call cut short still brings back the first
# answers in $OUT (bits.txt, g-path.txt, log, then s/: the SonicMoE bench's JSON, plot and log;
# ncu-g.txt, sass-g.csv.gz, ncu-forward.txt, sass-forward.csv.gz: at most 8 files in all).
#
#   prepared/call.sh build          here, before the call: .whl/mok (this tree: what the bench's
#                                   JSON names once committed) and, if absent, .whl/sonic
#                                   (tools/gpu_wheels.py sonic); ~3 min a folder on two cores; a
#                                   Python 3.12 with scikit-build-core, pybind11, cmake, ninja,
#                                   setuptools and wheel: $MOK_WHEEL_PYTHON
#   prepared/call.sh folders        here: the wheel folders of session 55's steps (mok-base: main;
#                                   mok, mok-r, mok-e, mok-eg, mok-i, mok-ei: main with their
#                                   patches, below), ~2.5 min each on two cores
#   prepared/call.sh lean | unlean  here, around a call that carries .whl/sonic: benchmarks/results,
#                                   NOTES.md and docs/ out of the tree (to /tmp/mok-lean) and back,
#                                   so that the tree and the folders fit the call's 64 MiB
#                                   (none of them is run or listed in TREE)
#   prepared/call.sh [STEP ...]     on the GPU machine (device `run`, carry the folders the steps
#                                   use: dw1, dw1ncu, gsass, fwd .whl/mok; tstore .whl/mok and
#                                   .whl/mok-base; routes those and .whl/mok-r; rlane, rtests
#                                   .whl/mok-r; early .whl/mok-base, -e, -i, -ei and -eg; etests
#                                   .whl/mok-ei, -eg; sonic .whl/mok and .whl/sonic): the steps
#                                   named (dw1, dw1ncu, tstore, routes, rlane, rtests, early,
#                                   etests, sonic, gsass, fwd below), or tstore; then
#   prepared/call.sh summary [DIR]  the bits per case and build, the tests' lines (DIR: default $OUT)
#
# Session 53 wrote the dw1 step (dW1's modes and the gather-x lane, in turns); session 54 ran its
# clusters and lag steps (the weight gradients in clusters of four, 621ce1a; dw1_mode 3's send two
# k-blocks late: both in git history, NOTES.md) and wrote tstore (C transposed in whole sectors);
# session 55 (no device lent) wrote routes, rlane and rtests (the gathering producer's routes in
# shared memory, on top of the sectors, and the gather-x lane on both), early and etests (stages
# given back without a queued group of wgmmas, the megakernel's and the other GEMMs'; the
# megakernel's gate/up and down tiles interleaved in the ticket order).
set -o pipefail
cd "$(dirname "$0")/.."
LEAN=/tmp/mok-lean
if [ "${1:-}" = build ]; then
  py=${MOK_WHEEL_PYTHON:-python3.12}
  python3 tools/gpu_wheels.py build --python "$py" || exit 1
  [ -d .whl/sonic ] || python3 tools/gpu_wheels.py sonic || exit 1
  exit 0
fi
if [ "${1:-}" = folders ]; then  # here: every wheel folder the steps of session 55 carry, from main
  py=${MOK_WHEEL_PYTHON:-python3.12}
  folder() {  # folder NAME [PATCH ...]: main's packages with the patches applied, into .whl/NAME
    local name=$1 args=()
    shift
    for patch in "$@"; do args+=(--patch "$patch"); done
    python3 tools/gpu_wheels.py build --python "$py" --base main "${args[@]}" --out ".whl/$name" || exit 1
  }
  folder mok-base
  folder mok prepared/wgrad-transposed-sectors.patch
  folder mok-r prepared/wgrad-transposed-sectors.patch prepared/wgrad-route-chunks.patch
  folder mok-e prepared/megakernel-stage-back-early.patch
  folder mok-eg prepared/megakernel-stage-back-early.patch prepared/stage-back-early-gemms.patch
  folder mok-i prepared/megakernel-interleaved-tasks.patch
  folder mok-ei prepared/megakernel-stage-back-early.patch prepared/megakernel-interleaved-tasks.patch
  exit 0
fi
if [ "${1:-}" = lean ]; then
  [ -e $LEAN ] && { echo "call.sh: $LEAN exists (unlean first)" >&2; exit 1; }
  mkdir -p $LEAN/benchmarks && mv benchmarks/results $LEAN/benchmarks/ && mv NOTES.md docs $LEAN/ || exit 1
  exit 0
fi
if [ "${1:-}" = unlean ]; then
  mv $LEAN/benchmarks/results benchmarks/ && mv $LEAN/NOTES.md $LEAN/docs . && rm -r $LEAN || exit 1
  git status --short | head
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
# the committed digests (main's since session 49) beside this call's (absent in a lean tree)
COMMITTED=benchmarks/results/profiles/2026-12-07_nvidia-h100_bits-digest-dw1.txt
[ -f $COMMITTED ] && { echo "## committed-dw1"; cat $COMMITTED; } >>"$OUT/bits.txt"
BACKWARD="tests/bf16/test_bf16_grouped_backward.py tests/bf16/test_moe_backward_call.py"
in_turns() {  # in_turns FILE SECONDS "BUILD ..." PROBE [ARG ...]: the probe under each build's
  # wheels in the order given, its output into $OUT/FILE under a "## BUILD" line each
  local file=$1 seconds=$2 builds=$3 b
  shift 3
  for b in $builds; do
    wheels "$b"
    echo "## $b" >>"$OUT/$file"
    timeout "$seconds" python3 "$P/$1" "${@:2}" >>"$OUT/$file" 2>&1
    echo "rc=$? $1 $b" >>"$L"
  done
}
sanitize_lane() {  # memcheck and racecheck over the GEMMs of test_megakernel's SANITIZE layer call
  # with the gather-x lane on (the forward storing no x, dW1 in mode 2: gathered and transposed)
  local lane_script
  lane_script="import mok_torch.backends.native as n; n.GATHER_X_MAX_INNER = 256
$(python3 -c 'import sys; sys.path[:0] = ["tests/bf16", "tests"]; from test_megakernel import SANITIZE; print(SANITIZE)')"
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool=$tool --kernel-name kns=gemm \
      python3 -c "$lane_script" full >/tmp/san.txt 2>&1
    echo "rc=$? sanitizer $tool over the gemms, the lane on" >>"$L"
    grep -E "ERROR SUMMARY|errors, .* warnings|ran" /tmp/san.txt | tail -3 >>"$L"
  done
}
step_dw1() {  # dW1's modes (dwd_gather.py --dw1 --modes=DW1_MODES, default 0,1,2: 0 the stored x's
  # rows, 1 x^T [d_a, d_b] from them, 2 the same gathering x by route), then the gather-x lane
  # (the forward storing no x, dW1 in mode 2) against main's path in one process, both in turns;
  # the bits, the backward's tests, the sanitizers over the backward's GEMMs and the lane's
  # backward. A short call: DW1_ROUNDS=1 DW1_SHAPES=sonic-7b DW1_TESTS=90
  wheels mok; mark dw1; bits mok
  # shellcheck disable=SC2086
  timeout 150 python3 $P/dwd_gather.py --dw1 --modes="${DW1_MODES:-0,1,2}" --rounds="${DW1_ROUNDS:-2}" ${DW1_SHAPES:-sonic-7b qwen3-30b-a3b} \
    >"$OUT/dw1.txt" 2>&1
  echo "rc=$? dw1 modes" >>"$L"
  mark lane
  # shellcheck disable=SC2086
  timeout 150 python3 $P/gather_x_lane.py --rounds="${DW1_ROUNDS:-2}" ${DW1_SHAPES:-sonic-7b qwen3-30b-a3b} \
    >>"$OUT/dw1.txt" 2>&1
  echo "rc=$? lane" >>"$L"
  mark tests
  tests reference "${DW1_TESTS:-150}" $BACKWARD -k "not sanitizer"
  tests cuda 90 tests/layer/test_determinism.py
  tests reference 130 tests/bf16/test_megakernel.py -k "sanitizer and gemm and (racecheck or memcheck)"
  sanitize_lane
}
step_gsass() {  # ncu on the fused g kernel at sonic-7b, dy gathered (dwd_gather 1, an H100's
  # default; the third launch: warm-up, copied, gathered): the sections and each SASS
  # instruction's stall samples, for its next form (NOTES.md, session 50); the bits, the tests.
  # GSASS_BUILD: the wheel folder (default mok)
  local b=${GSASS_BUILD:-mok}
  wheels "$b"; mark "gsass $b"
  timeout 150 ncu --clock-control none --kernel-name regex:g_swiglu_gemm --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --import-source no -f -o /tmp/g python3 $P/dwd_gather.py sonic-7b --ncu >"$OUT/ncu-g.txt" 2>&1
  echo "rc=$? ncu g" >>"$L"
  ncu -i /tmp/g.ncu-rep --print-summary none >>"$OUT/ncu-g.txt" 2>&1
  ncu -i /tmp/g.ncu-rep --page source --csv --print-source sass 2>>"$L" | gzip >"$OUT/sass-g.csv.gz"
  bits "$b"
  tests reference "${GSASS_TESTS:-200}" $BACKWARD
}
step_dw1ncu() {  # ncu on the weight gradients at sonic-7b (dwd_gather.py --ncu --dw1: after one
  # warm-up backward, dWd and dW1 of dw1_mode 0, 1, 2 in turn): what bounds each form of dW1
  wheels mok; mark dw1ncu
  timeout 200 ncu --clock-control none --kernel-name regex:wgrad_gemm --launch-skip 2 --launch-count 6 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section LaunchStats -f -o /tmp/w python3 $P/dwd_gather.py sonic-7b --ncu --dw1 >"$OUT/ncu-dw1.txt" 2>&1
  echo "rc=$? ncu dw1" >>"$L"
  ncu -i /tmp/w.ncu-rep --print-summary none >>"$OUT/ncu-dw1.txt" 2>&1
}
step_sonic() {  # mok (main, .whl/mok: the tree's own build) against SonicMoE and torch-a2a, the
  # bench in turns (tools/gpu-check's sonic stage; its JSON names the commit) on SONIC_SHAPES
  mark sonic; mkdir -p "$OUT/s"
  MOK_SONIC_SHAPES=${SONIC_SHAPES:-sonic-7b,qwen3-30b-a3b} MOK_SONIC_CHECK=0 tools/gpu-check "$OUT/s" sonic \
    >"$OUT/s/log" 2>&1
  echo "rc=$? sonic" >>"$L"
  grep -v "^warning" "$OUT/s/log" | tail -6
}
step_fwd() {  # ncu on main's forward megakernel at sonic-7b: its sections and per-instruction
  # stall table (NOTES.md, session 49, item 2: is its gate/up feed bound by the L2's bytes?)
  wheels mok; mark fwd
  timeout 150 ncu --clock-control none --kernel-name regex:moe_forward --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section SourceCounters --import-source no -f -o /tmp/fwd python3 $P/megakernel_ncu.py sonic-7b \
    >"$OUT/ncu-forward.txt" 2>&1
  echo "rc=$? ncu forward" >>"$L"
  ncu -i /tmp/fwd.ncu-rep --print-summary none >>"$OUT/ncu-forward.txt" 2>&1
  ncu -i /tmp/fwd.ncu-rep --page source --csv --print-source sass 2>>"$L" | gzip >"$OUT/sass-forward.csv.gz"
}
step_tstore() {  # dW1 with C stored transposed (dw1_mode 1, 2) in whole sectors (.whl/mok: main
  # with prepared/wgrad-transposed-sectors.patch applied) against main's half-sector stores
  # (.whl/mok-base), in turns, two rounds: dwd_gather.py
  # --dw1 --modes=0,1,2 at sonic-7b and qwen3-30b-a3b (NOTES.md, session 54's prediction); then
  # the bits of both and, under the tree's build, the backward's tests (every dw1_mode bitwise)
  mark tstore
  in_turns tstore.txt 100 "mok-base mok mok-base mok" dwd_gather.py --dw1 --modes=0,1,2 sonic-7b qwen3-30b-a3b
  wheels mok-base; bits mok-base
  wheels mok; bits mok
  tests reference "${TSTORE_TESTS:-150}" $BACKWARD -k "not sanitizer"
}
step_routes() {  # the gathering weight gradients' routes in shared memory (.whl/mok-r: main with
  # prepared/wgrad-transposed-sectors.patch and prepared/wgrad-route-chunks.patch applied) beside
  # main (.whl/mok-base) and main + the sectors alone (.whl/mok), in turns, two rounds: dWd as the
  # device's default (gathered on an H100 at I <= 256) and dW1 in modes 0-2 (NOTES.md, session 55's
  # prediction); then the bits of the three
  mark routes
  in_turns routes.txt 100 "mok-base mok mok-r mok-base mok mok-r" \
    dwd_gather.py --dw1 --modes=0,1,2 sonic-7b qwen3-30b-a3b
  for b in mok-base mok mok-r; do wheels $b; bits $b; done
}
step_rlane() {  # the gather-x lane (the forward storing no x, dW1 in mode 2) against main's path
  # under .whl/mok-r (both patches), in turns in one process, two rounds: the decision the two
  # patches are for (NOTES.md, session 55)
  wheels mok-r; mark rlane
  timeout 170 python3 $P/gather_x_lane.py --rounds=2 sonic-7b qwen3-30b-a3b >"$OUT/rlane.txt" 2>&1
  echo "rc=$? rlane" >>"$L"
}
step_early() {  # the forward megakernel's two prepared changes and the GEMMs' early release, in
  # turns with main (.whl/mok-base), two rounds (NOTES.md, session 55's predictions):
  # megakernel_timers.py at sonic-7b and qwen3-30b-a3b under .whl/mok-e (main with
  # prepared/megakernel-stage-back-early.patch), .whl/mok-i (main with
  # prepared/megakernel-interleaved-tasks.patch) and .whl/mok-ei (both); the backward's kernels
  # (dwd_gather.py --dw1 --modes=0: the g GEMM, dx, dWd, dW1) under .whl/mok-eg (the early patch
  # and prepared/stage-back-early-gemms.patch); then the bits of all five
  mark early
  in_turns early.txt 60 "mok-base mok-e mok-i mok-ei mok-base mok-e mok-i mok-ei" \
    megakernel_timers.py sonic-7b qwen3-30b-a3b
  in_turns early.txt 60 "mok-base mok-eg mok-base mok-eg" dwd_gather.py --dw1 --modes=0 sonic-7b qwen3-30b-a3b
  for b in mok-base mok-e mok-i mok-ei mok-eg; do wheels $b; bits $b; done
}
step_etests() {  # the megakernel's tests (bitwise the chain at every grid, the sanitizers) under
  # .whl/mok-ei (both of its patches), the grouped GEMMs' and the backward's under .whl/mok-eg
  wheels mok-ei; mark etests
  tests reference "${ETESTS_MEGAKERNEL:-200}" tests/bf16/test_megakernel.py
  wheels mok-eg
  tests reference "${ETESTS_GEMMS:-250}" tests/bf16/test_bf16_grouped.py $BACKWARD -k "not sanitizer"
}
step_rtests() {  # under .whl/mok-r: the backward's tests (every dw1_mode and dwd_gather bitwise,
  # segments past one chunk of routes), the sanitizers over the backward's GEMMs and over a layer
  # call with the gather-x lane on (dW1 in mode 2)
  wheels mok-r; mark rtests
  tests reference "${RTESTS_TESTS:-170}" $BACKWARD -k "not sanitizer"
  tests reference 130 tests/bf16/test_megakernel.py -k "sanitizer and gemm and (racecheck or memcheck)"
  sanitize_lane
}
for step in "${@:-tstore}"; do
  for s in $step; do "step_$s"; done
done
mark done
