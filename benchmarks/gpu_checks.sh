#!/usr/bin/env bash
# The checks a lent GPU machine runs, in one call, most important first: the
# GPU test suite, then the GPU benchmarks. Each step has its own time limit,
# writes its full log to $OUT/<step>.log and prints the log's tail.
#
#   bash benchmarks/gpu_checks.sh                # every step
#   bash benchmarks/gpu_checks.sh tests demo     # the named steps only
#
# Keras travels as wheels in .whl/ (the machine has JAX and CuPy, no Keras):
# see BENCHMARKS.md, "GPU rows".
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export KERAS_BACKEND=jax XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests calls fields profile demo table peers)

run_step() {  # name, seconds, command...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc after $(($(date +%s) - start)) s"
  tail -n "${TAIL:-18}" "$OUT/$name.log"
}

for step in "${steps[@]}"; do
  case $step in
  tests) run_step tests 200 env XLA_FLAGS=--xla_gpu_deterministic_ops=true \
    python3 -m pytest tests/gpu -q -p no:cacheprovider -n 4 --timeout 150 ;;
  calls) run_step calls 90 python3 benchmarks/gpu_table_calls.py --calls 30 ;;
  fields) run_step fields 130 python3 benchmarks/hash_embedding.py --gpu-table \
    --only "${FIELDS_ONLY:-prefetch,raw-gpu,raw-gpu-together,baseline}" --repeats 3 ;;
  profile) run_step profile 150 python3 benchmarks/gpu_step_profile.py ;;
  profile-nographs) run_step profile-nographs 150 env \
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 benchmarks/gpu_step_profile.py ;;
  trace) run_step trace 240 python3 benchmarks/gpu_step_profile.py \
    --only "${TRACE_ONLY:-AllToAll,collection}" --trace /tmp/gpu_traces
    mkdir -p "$OUT/traces"
    for f in /tmp/gpu_traces/*/plugins/profile/*/perfetto_trace.json.gz; do
      [ -e "$f" ] && cp "$f" "$OUT/traces/$(echo "$f" | cut -d/ -f4).json.gz"
    done ;;
  demo) run_step demo 120 python3 benchmarks/many_fields.py \
    ${DEMO_ONLY:+--only $DEMO_ONLY} ;;
  demo-trace) run_step demo-trace 150 python3 benchmarks/many_fields.py \
    --only "${DEMO_ONLY:-keras,dense,hash-gpu}" --trace /tmp/many_fields_traces ;;
  phases) run_step phases 120 python3 benchmarks/gpu_call_phases.py \
    --teams "${PHASE_TEAMS:-1,0}" ;;
  table) run_step table 90 python3 benchmarks/hash_table.py --device gpu \
    ${GRID_BLOCKS:+--grid-blocks $GRID_BLOCKS} ;;
  peers) run_step peers 150 python3 benchmarks/peers.py --rows "${PEERS_ROWS:-1e7}" \
    --variants ks-jax-layers,ks-jax-collection,keras-dense --rounds 1 \
    --warmup 2 --steps 10 --timeout 140 ;;
  *) echo "unknown step: $step" ;;
  esac
done
