#!/usr/bin/env bash
# Runs the whole suite once per Keras backend (the GPU suite with JAX), ending with
# one line totalling every run; exits non-zero on any failure.
set -u
cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export TF_CPP_MIN_LOG_LEVEL=2
status=0
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

# Adds the counts of pytest's closing line (read from $log) to the totals.
passed=0 failed=0 skipped=0 errors=0
tally() {
  local line n
  line="$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' "$log" | tail -1)"
  for kind in passed failed skipped error; do
    n="$(grep -oE "[0-9]+ ${kind}" <<<"$line" | grep -oE '^[0-9]+' || true)"
    n="${n:-0}"
    case $kind in
      passed) passed=$((passed + n)) ;;
      failed) failed=$((failed + n)) ;;
      skipped) skipped=$((skipped + n)) ;;
      error) errors=$((errors + n)) ;;
    esac
  done
}

# The JAX run also collects tests/gpu (the GPU suite: it skips, with its
# reason, where CuPy sees no CUDA device). The other backends skip it.
for backend in jax tensorflow torch; do
  echo "=== KERAS_BACKEND=$backend ==="
  if [ "$backend" = jax ]; then
    marker="" extra=()
  else
    marker="not backend_independent" extra=(--ignore=tests/gpu)
  fi
  KERAS_BACKEND=$backend python -m pytest tests ${extra[@]+"${extra[@]}"} -q -rfEs \
    -p no:cacheprovider --durations=20 -m "$marker" "$@" 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  tally
done

failed=$((failed + errors))
if [ "$passed" -eq 0 ]; then status=1; fi
echo "=== all runs ==="
echo "total: ${passed} passed, ${failed} failed, ${skipped} skipped"
exit $status
