#!/usr/bin/env bash
# Runs the whole suite once per Keras backend; exits non-zero on any failure.
set -u
cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export TF_CPP_MIN_LOG_LEVEL=2
status=0
for backend in jax tensorflow torch; do
  echo "=== KERAS_BACKEND=$backend ==="
  if [ "$backend" = jax ]; then marker=""; else marker="not backend_independent"; fi
  KERAS_BACKEND=$backend python -m pytest tests --ignore=tests/gpu -q \
    -p no:cacheprovider -m "$marker" "$@" || status=1
done
echo "=== GPU suite (skips without a CUDA device) ==="
python -m pytest tests/gpu -q -p no:cacheprovider -rs "$@"
rc=$?
# Exit code 5 means every GPU test was skipped or none was collected.
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=1; fi
exit $status
