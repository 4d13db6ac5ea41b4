#!/usr/bin/env bash
# The bench call on a lent GPU (docs/bench.md, "On a lent GPU"), run by the device tool in the
# project's root, in the call that carries .gpu/c2, right after `source .gpu/c2/install.sh`
# (the call before, carrying .gpu/c1, ran `python3 .gpu/c1/unpack.py`):
#
#   source .gpu/c2/install.sh && bash bench/gpu_device.sh
#
# First the preflight (the stack on the synthetic engine, seconds: a missing wheel fails
# here, not after vLLM's minutes), then python -m bench.gpu on a random-weight model of
# SmolLM2's shape (the tokenizer and config that pack.sh carries in .gpu/c2/tok), both vLLM
# modes (CUDA graphs, then eager, while time is left), every result and log into $OUT.
# BENCH_GPU_ARGS adds flags (they override the defaults: --streams 1 64 --tokens 64 ...).
#
# Two things the lent machine's limits ask of the calls:
# - `vllm serve` imports more than the worker does: pack.sh's c2 needs
#   EXTRA_WHEELS="watchfiles==1.3.0 model-hosting-container-standards==0.1.16
#   supervisor==4.3.0 jmespath==1.1.0" (checked below, before the first vLLM starts).
# - Each call carries the working tree beside .gpu/c1 or c2, 64 MiB in all: c1 is 61 MB,
#   so move docs/ and tests/ (6.5 MB, neither is needed there) aside for the two calls.
set -euo pipefail
out=${OUT:?OUT: the folder whose files come back (the device tool sets it)}
shape=${SHAPE:-.gpu/c2/tok}
call_s=${CALL_S:-590}  # one call runs at most 600 s, from when the call's shell started
gone=$(python3 -c "from stack.procfs import age_s; print(int(age_s($PPID)))")
left=$((call_s - gone))
echo "[gpu_device] ${gone} s gone in this call (install.sh), ${left} s left for the bench"
[ "$left" -gt 240 ] || { echo "[gpu_device] too little time left: run it in a fresh call"; exit 1; }
[ -f "$shape/config.json" ] || { echo "[gpu_device] $shape/config.json missing (pack.sh makes it)"; exit 1; }
mkdir -p "$out/logs"
{ nvidia-smi; python3 -c 'import sys, torch; print(sys.version, torch.__version__, torch.version.cuda)'; } \
  > "$out/machine.txt" 2>&1 || true
# Both sides start vLLM with its own defaults (its engine core forked): the worker touches
# no CUDA before vLLM does (engine/backends/vllm_api.py), and this run is the GPU's
# check of that. VLLM_WORKER_MULTIPROC_METHOD=spawn in the environment still goes through.
python3 -m bench.gpu --preflight --out "$out" --logs "$out/logs"
python3 -c "import vllm.entrypoints.openai.api_server" ||
  { echo "[gpu_device] vllm serve does not import: pack c2 with EXTRA_WHEELS (above)"; exit 1; }
left=$((left - SECONDS))  # SECONDS: this script's own time so far
# No mode starts unless the last one's time still fits; SIGTERM at the end stops every
# process and keeps what was measured (results are written after each side).
timeout -k 15 "$((left - 20))" python3 -m bench.gpu --model random --shape "$shape" \
  --model-dir /tmp/random-model --out "$out" --logs "$out/logs" --no-plot \
  --deadline-s "$((left - 40))" ${BENCH_GPU_ARGS:-}
