#!/usr/bin/env bash
# The GPU check, one command on one GPU (under 8 minutes on an H200):
#   1. the CUDA parity tests (pytest -m cuda: fla, torch's flash kernels and the compiled Triton kernels against
#      the project's float64 references; the `triton` tests proper run the interpreter on CPU tensors, in CI);
#   2. bench/gpu_check.py: each fast path timed beside its library peer and its torch fallback, then GRPO steps of
#      the Qwen3.6-27B layer shape at growing prompt lengths until memory runs out; rows for BENCHMARKS.md in
#      OUT/gpu_check.md and OUT/gpu_check.json, the steps' plot in OUT/grpo_step.png (where matplotlib is).
#
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [--budget SECONDS] [--sections a,b,...]
#
# --dry-run: on a CPU machine, toy sizes, the tests only collected (CI runs them): proves the script end to end
# (tests/unit/test_gpu_check.py). On a machine without the project's packages (an offline GPU machine), wheels in .whl/
# (transformers, deepspeed, fla-core, ...: FACTS.md) and the project itself are installed into /tmp/longstraw_site.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
out="${OUT:-bench/results/gpu_check}"
budget=330
sections=attention,gated_delta,logprobs,triton,grpo_step
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
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

tests=(tests/unit/test_cuda_paths.py tests/unit/test_logprobs.py)
for file in tests/test_triton_*.py; do [ -e "$file" ] && tests+=("$file"); done
# GPU_CHECK_TESTS="a.py b.py": only those test files (a rerun after a fix)
[ -n "${GPU_CHECK_TESTS:-}" ] && read -r -a tests <<<"$GPU_CHECK_TESTS"
echo "== 1. CUDA parity tests: ${tests[*]} =="
# -P: the checkout's own ds_longstraw/ (without its kernels, which an install maps in) must not shadow the install
if [ "$dry" = 1 ]; then
  $python -P -m pytest -q --collect-only -m cuda "${tests[@]}" | tail -1
  tests_rc=${PIPESTATUS[0]}
else
  $python -P -m pytest -q -m cuda "${tests[@]}" -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25
  tests_rc=${PIPESTATUS[0]}
fi

echo "== 2. kernels and GRPO steps (bench/gpu_check.py) =="
dry_flag=()
[ "$dry" = 1 ] && dry_flag=(--dry-run)
$python -P bench/gpu_check.py "${dry_flag[@]}" --out "$out" --budget "$budget" --sections "$sections"
bench_rc=$?
echo "gpu_check: tests rc $tests_rc, benchmarks rc $bench_rc; results in $out"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
