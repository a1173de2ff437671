#!/usr/bin/env bash
# jaxkv on a Cloud TPU VM: set up, serve the shared-prefix workload with Llama-3.2-1B
# shapes on the Pallas TPU kernel, and run the TPU kernel benchmark.
#
# STATUS: NOT RUN ON A TPU. Nothing in jaxkv has run on TPU hardware yet. The Pallas TPU
# kernel passes its tests in the TPU interpreter on the CPU, lowers for TPU on a CPU-only
# machine, and compiles with Mosaic ahead of time there (opt-in test with libtpu). This
# script itself, the serving run with Llama-3.2-1B shapes and every timing below are
# unverified until it runs on a TPU VM. Expect to fix things on the first run.
#
# Run it on the TPU VM, from a copy of this repository (for example copied there with
# `gcloud compute tpus tpu-vm scp --recurse jaxkv VM_NAME: --zone ZONE`):
#
#     bash examples/cloud_tpu.sh            # everything below, about 15 minutes
#
# Creating the VM happens on your workstation and depends on your project's quota;
# one v5e chip is enough for the 1B shapes (check the accelerator types and runtime
# versions your zone offers with `gcloud compute tpus tpu-vm accelerator-types list`):
#
#     gcloud compute tpus tpu-vm create jaxkv-tpu --zone ZONE \
#         --accelerator-type v5litepod-1 --version RUNTIME_VERSION
#     gcloud compute tpus tpu-vm ssh jaxkv-tpu --zone ZONE
set -euo pipefail
cd "$(dirname "$0")/.."

# 1. A virtual environment with JAX for TPU (from the package index) and jaxkv.
python3 -m venv .venv-tpu
source .venv-tpu/bin/activate
python -m pip install -U pip
python -m pip install -U "jax[tpu]"
python -m pip install -e ".[bench]"
python -c "import jax, sys; print(jax.devices()); jax.default_backend() == 'tpu' or sys.exit(
    'no TPU found (jax runs on ' + jax.default_backend() + '): run this on a Cloud TPU VM')"

mkdir -p benchmarks/results

# 2. The main job with Llama-3.2-1B shapes (random weights, bfloat16) on the Pallas TPU
#    kernel: 64 requests under two system prompts sharing a 2048-token prefix. Prints
#    the same table as on the CPU, cascade on vs off, and checks that their tokens agree.
#    Its transcript goes to a temporary file beside serve_tpu.txt, renamed over it once
#    the run has ended well (as the benchmarks write their JSON): a run killed or failed
#    leaves the previous serve_tpu.txt, and its own transcript as .serve_tpu.tmp.txt.
python examples/serve_shared_prefix.py --preset llama3_2_1b --backend pallas_tpu \
    --num-requests 64 --prefix-len 2048 --max-tokens 64 | tee benchmarks/results/.serve_tpu.tmp.txt
mv benchmarks/results/.serve_tpu.tmp.txt benchmarks/results/serve_tpu.txt

# 3. The TPU kernel benchmark: checks the kernel against the reference on the device,
#    then times flat vs cascade decode (Llama-3-8B heads) against the chip's peak HBM
#    bandwidth. Writes benchmarks/results/tpu_kernel.json.
python benchmarks/tpu_kernel.py --out benchmarks/results/

