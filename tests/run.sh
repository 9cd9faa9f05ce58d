#!/usr/bin/env bash
# Runs the whole suite once per Keras backend (the GPU suite with JAX), ending with
# one line totalling every run; exits non-zero on any failure.
#
# Two lanes run side by side (most of a test's time is single-threaded Python
# and compilation, so two cores finish both lanes in about the time of the
# longer one): JAX, printed as it runs; TensorFlow then PyTorch, printed when
# done. KS_TEST_LANES=1 runs the three backends one after the other instead.
set -u
cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export TF_CPP_MIN_LOG_LEVEL=2
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

# One backend's pytest run; its output goes to $logs/<backend>.log (and to
# stdout when $2 is "live"), its exit status to $logs/<backend>.rc.
# The JAX run also collects tests/gpu (the GPU suite: it skips, with its
# reason, where CuPy sees no CUDA device). The other backends skip it.
run_backend() {
  local backend=$1 mode=$2 marker extra
  shift 2
  if [ "$backend" = jax ]; then
    marker="" extra=()
  else
    marker="not backend_independent" extra=(--ignore=tests/gpu)
  fi
  {
    echo "=== KERAS_BACKEND=$backend ==="
    KERAS_BACKEND=$backend python -m pytest tests ${extra[@]+"${extra[@]}"} -q -rfEs \
      -p no:cacheprovider --durations=20 -m "$marker" "$@" 2>&1
    echo $? >"$logs/$backend.rc"
  } | if [ "$mode" = live ]; then tee "$logs/$backend.log"; else cat >"$logs/$backend.log"; fi
}

if [ "${KS_TEST_LANES:-2}" = 1 ]; then
  for backend in jax tensorflow torch; do run_backend "$backend" live "$@"; done
else
  (run_backend tensorflow quiet "$@"; run_backend torch quiet "$@") &
  other_lane=$!
  run_backend jax live "$@"
  wait "$other_lane"
  cat "$logs/tensorflow.log" "$logs/torch.log"
fi

# Totals of pytest's closing lines; any failing run or missing status fails.
status=0 passed=0 failed=0 skipped=0
for backend in jax tensorflow torch; do
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
