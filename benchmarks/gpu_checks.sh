#!/usr/bin/env bash
# Every check and benchmark that needs an NVIDIA GPU, in one bounded run:
#   1. the machine: nvidia-smi, and the versions of Python, jax, jaxlib, flax and optax;
#   2. the whole test suite on the GPU: the kernel tests run the compiled kernel (the
#      harness interprets only off its platform) and the engine serves with pallas_gpu;
#      each test's result is logged as it ends, so a stage cut by its limit still says
#      which tests ran;
#   3. benchmarks/gpu_kernel.py: the kernel checked against the reference on the device,
#      then flat, cascade and JAX's paged attention timed against the copy bandwidth, with
#      bfloat16 queries over a bfloat16 cache, and at B=64, P=8192, S=128 also over a
#      float32 cache (float32 dots), right after, for the cost of that pair;
#   4. benchmarks/serve.py, cascade against flat with prefix caching: the tiny model as in
#      the README's CPU table, then Llama-3.2-1B shapes under a 2048-token system prompt,
#      with decode steps run on 128 token slots rather than padded to 2048.
# Results go to $OUT (default gpu_results/): env.txt, pytest.log, pytest.xml,
# gpu_kernel.json, gpu_kernel.log, serve.log, serve_tiny.json and serve_1b.json. Each stage
# has a time limit in seconds (GPU_TEST_S, GPU_BENCH_S, GPU_SERVE_S, GPU_SERVE_1B_S), so
# one stuck stage cannot eat the others' time. Exits non-zero when a stage failed. On an
# H200 the stages took about 200, 95, 30 and 60 seconds (jax 0.11.2, 16 CPU cores), before
# the float32-cache cell and its three checks were added to the gpu_kernel stage (its
# limits are 10 s longer for them).
#
#   OUT=/tmp/gpu bash benchmarks/gpu_checks.sh     # from the repository root
set -u
OUT=${OUT:-gpu_results}
PY=${PYTHON:-python3}
# Off a GPU every stage would run anyway: the whole suite on the CPU, then serve.py's CPU
# figures filed as the GPU's. Stop first, saying why, before anything is written.
if ! backend=$("$PY" -c 'import jax; print(jax.default_backend())'); then
    echo "benchmarks/gpu_checks.sh: $PY cannot import jax" >&2
    exit 2
fi
if [ "$backend" != gpu ]; then
    echo "benchmarks/gpu_checks.sh: no GPU found (jax runs on $backend): run it on a" \
        "machine with an NVIDIA GPU and jax's CUDA plugin" >&2
    exit 2
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

stage() {  # stage NAME LIMIT LOG COMMAND...: runs COMMAND under LIMIT, appending to LOG
    local name=$1 limit=$2 log=$3
    shift 3
    echo "== $name (limit ${limit} s)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name exit status: $rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

stage machine 60 "$OUT/env.txt" bash -c "nvidia-smi; $PY -c 'import sys, jax, jaxlib, flax, optax
print(sys.version)
print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"flax\", flax.__version__, \"optax\", optax.__version__)
print(jax.devices())'"

stage tests "${GPU_TEST_S:-300}" "$OUT/pytest.log" "$PY" -m pytest -n "${GPU_TEST_WORKERS:-8}" \
    --dist loadfile tests -o addopts= -v -rfE --durations=25 --junitxml="$OUT/pytest.xml"

stage gpu_kernel "${GPU_BENCH_S:-140}" "$OUT/gpu_kernel.log" "$PY" benchmarks/gpu_kernel.py \
    --out "$OUT" --max-seconds "${GPU_BENCH_CONFIG_S:-90}" \
    --kv-dtype bfloat16 float32 --kv-dtype-cells 64,8192,128

configs=cascade+prefix_cache,flat+prefix_cache
stage serve_tiny "${GPU_SERVE_S:-60}" "$OUT/serve.log" "$PY" benchmarks/serve.py \
    --configs "$configs" --out "$OUT/serve_tiny.json"
stage serve_1b "${GPU_SERVE_1B_S:-90}" "$OUT/serve.log" "$PY" benchmarks/serve.py \
    --configs "$configs" --preset llama3_2_1b --system-len 2048 --num-requests 128 \
    --min-tokens-bucket 128 --out "$OUT/serve_1b.json"
exit "$status"
