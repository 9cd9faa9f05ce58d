#!/usr/bin/env bash
# Runs the whole suite once per Keras backend (the GPU suite with JAX, on a real
# GPU where there is one and always on the CPU emulation of CUDA), ending with
# one line totalling every run; exits non-zero on any failure.
#
# Two lanes run side by side (most of a test's time is single-threaded Python
# and compilation, so two cores finish both lanes in about the time of the
# longer one): JAX then the emulated GPU suite, printed as they run;
# TensorFlow then PyTorch. While they run, each prints one line per finished
# test file ("[jax] tests/test_x.py: 12 passed (9 s)"); their full pytest
# output follows when both lanes are done. KS_TEST_LANES=1 runs the four one
# after the other instead, each printed live.
set -u
for arg in "$@"; do
  case $arg in
    -h | --help)
      cat <<'USAGE'
Usage: bash tests/run.sh [PYTEST ARGS...]

Runs the test suite once per Keras backend: jax, the GPU suite (tests/gpu)
on JAX with CUDA emulated on the CPU, tensorflow and torch (tests marked
backend_independent run in the jax run only). Ends with one line totalling
every run; exits non-zero on any failure.

Environment:
  KS_TEST_LANES=1  run the four one after the other, each printed live
                   (default 2: two lanes side by side, jax then the
                   emulated GPU suite, and tensorflow then torch; their
                   output follows when both are done)

Every other argument goes to each pytest run, e.g.
  bash tests/run.sh -k hash_table -x
USAGE
      exit 0 ;;
  esac
done
cd "$(dirname "$0")/.."
# Deterministic GPU reductions: the GPU suite compares GPU and CPU tables
# bit for bit (a no-op on CPUs).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true"
export TF_CPP_MIN_LOG_LEVEL=2
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

# One run's pytest output goes to $logs/<run>.log (and to stdout when $2 is
# "live"), its exit status to $logs/<run>.rc. Runs: one per Keras backend,
# and "emulated-gpu": the GPU suite (tests/gpu) on JAX with CUDA emulated on
# the CPU (tests/cuda_emulation: the real kernels compiled for the host, a
# NumPy-backed cupy). The JAX run also collects tests/gpu for real GPUs (it
# skips, with its reason, where CuPy sees no CUDA device); TF and torch skip it.
run_backend() {
  local run=$1 mode=$2 backend=$1 marker="" paths=(tests) rc
  local pythonpath="${PYTHONPATH:-}"
  shift 2
  case $run in
    jax) ;;
    emulated-gpu)
      backend=jax paths=(tests/gpu)
      pythonpath="$PWD/tests/cuda_emulation/fake_cupy:$PWD${pythonpath:+:$pythonpath}" ;;
    *) marker="not backend_independent" paths=(tests --ignore=tests/gpu) ;;
  esac
  {
    echo "=== $run (KERAS_BACKEND=$backend) ==="
    KS_PROGRESS_FD=3 KS_PROGRESS_LANE=$run \
    PYTHONPATH=$pythonpath KERAS_BACKEND=$backend python -m pytest "${paths[@]}" -q \
      -rfEs -p no:cacheprovider --durations=20 -m "$marker" "$@" 2>&1
    rc=$?
    # A filter (-k ...) may leave one run nothing to collect (pytest: 5).
    if [ "$rc" = 5 ] && [ $# -gt 0 ]; then rc=0; fi
    echo $rc >"$logs/$run.rc"
  } | if [ "$mode" = live ]; then tee "$logs/$run.log"; else cat >"$logs/$run.log"; fi
}

RUNS="jax emulated-gpu tensorflow torch"
# File descriptor 3: the terminal, where each run prints a line per finished
# test file (tests/conftest.py) while its pytest output goes to its log.
exec 3>&1
if [ "${KS_TEST_LANES:-2}" = 1 ]; then
  for run in $RUNS; do run_backend "$run" live "$@"; done
else
  (run_backend tensorflow quiet "$@"; run_backend torch quiet "$@") &
  other_lane=$!
  (run_backend jax quiet "$@"; run_backend emulated-gpu quiet "$@")
  wait "$other_lane"
  cat "$logs/jax.log" "$logs/emulated-gpu.log" "$logs/tensorflow.log" "$logs/torch.log"
fi

# Totals of pytest's closing lines; any failing run or missing status fails.
status=0 passed=0 failed=0 skipped=0
for backend in $RUNS; do
  [ "$(cat "$logs/$backend.rc" 2>/dev/null)" = 0 ] || status=1
  line="$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' \
    "$logs/$backend.log" | tail -1)"
  for kind in passed failed skipped error; do
    n="$(grep -oE "[0-9]+ ${kind}" <<<"$line" | grep -oE '^[0-9]+' || true)"
    n="${n:-0}"
    case $kind in
      passed) passed=$((passed + n)) ;;
      failed | error) failed=$((failed + n)) ;;
      skipped) skipped=$((skipped + n)) ;;
    esac
  done
done

if [ "$passed" -eq 0 ]; then status=1; fi
echo "=== all runs ==="
echo "total: ${passed} passed, ${failed} failed, ${skipped} skipped"
exit $status
