#!/usr/bin/env bash
# The GPU check, one command on one GPU, under 10 minutes on an H200 (--budget: the whole script's seconds):
#   1. every CUDA-marked test, wherever it lives under tests/ (pytest -m cuda: fla, torch's flash and cuDNN kernels
#      and the compiled Triton kernels against the project's float64 references; the `triton` tests proper run the
#      interpreter on CPU tensors, in CI), at most a quarter of the budget;
#   2. bench/gpu_check.py in what is left: each fast path timed beside its library peer and its torch fallback,
#      GLM-5.2's layer shape through the transaction, GRPO steps of the whole 64-layer Qwen3.6-27B shape (LoRA, host
#      tier) beside the planner's figures; rows for BENCHMARKS.md in OUT/gpu_check.md and OUT/gpu_check.json, the
#      whole model's plot in OUT/whole_qwen.png (where matplotlib is).
#
#   bash bench/gpu_check.sh [--dry-run] [--no-tests] [--out DIR] [--budget SECONDS] [--sections a,b,...]
#
# The CUDA tests took about 6 minutes on the H200 (Triton compiles every kernel variant), more than their quarter:
# a session that has run them can give the whole budget to one section, e.g. --no-tests --sections whole_qwen.
#
# --dry-run: on a CPU machine, toy sizes, the tests only collected (CI runs them): proves the script end to end
# (tests/unit/test_gpu_check.py). On a machine without the project's packages (an offline GPU machine), the wheels in
# .whl/ (made here by bench/gpu_wheels.sh: transformers, deepspeed, fla-core, ...) and the project itself are
# installed into /tmp/longstraw_site.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
run_tests=1
out="${OUT:-bench/results/gpu_check}"
budget=560
sections=attention,logprobs,whole_qwen,glm_layer,triton,gated_delta
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --no-tests) run_tests=0 ;;
    --out) out="$2"; shift ;;
    --budget) budget="$2"; shift ;;
    --sections) sections="$2"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
export PYTHONUNBUFFERED=1

if [ "$dry" = 0 ] && ! $python -c "import ds_longstraw.kernels, deepspeed" 2>/dev/null; then
  echo "== installing the project into /tmp/longstraw_site =="
  site=/tmp/longstraw_site
  if [ -d .whl ]; then
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  $python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . || exit 1
  rm -rf build ds_longstraw.egg-info
fi

# Every test file that marks a test `cuda`, wherever it lives (tests/unit/, tests/equivalence/, ...)
mapfile -t tests < <(grep -rlE --include='test_*.py' 'pytest\.mark\.cuda|mark\.cuda' tests | sort)
# GPU_CHECK_TESTS="a.py b.py": only those test files (a rerun after a fix)
[ -n "${GPU_CHECK_TESTS:-}" ] && read -r -a tests <<<"$GPU_CHECK_TESTS"
echo "== 1. CUDA parity tests: ${tests[*]} =="
# -P: the checkout's own ds_longstraw/ (without its kernels, which an install maps in) must not shadow the install
if [ "$run_tests" = 0 ]; then
  echo "(skipped: --no-tests)"
  tests_rc=0
elif [ "$dry" = 1 ]; then
  $python -P -m pytest -q --collect-only -m cuda "${tests[@]}" | tail -1
  tests_rc=${PIPESTATUS[0]}
else
  timeout $((budget / 4)) $python -P -m pytest -q -m cuda "${tests[@]}" -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.log" | tail -40
  tests_rc=${PIPESTATUS[0]}
fi

left=$((budget - SECONDS))
echo "== 2. kernels, GLM-5.2's layer, the whole Qwen3.6-27B shape (bench/gpu_check.py, ${left} s left) =="
dry_flag=()
[ "$dry" = 1 ] && dry_flag=(--dry-run)
# the log beside the results: a call cut off at its limit (and its pipeline with it) still returns it
$python -P bench/gpu_check.py "${dry_flag[@]}" --out "$out" --budget "$left" --sections "$sections" 2>&1 \
  | tee "$out/gpu_check.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: tests rc $tests_rc, benchmarks rc $bench_rc; results in $out"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
