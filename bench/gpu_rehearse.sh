#!/usr/bin/env bash
# A rehearsal of the lent GPU's two calls here, as far as a machine without a GPU and torch
# goes (docs/bench.md, "On a lent GPU"): the working tree and .gpu copied as the device tool
# carries them, /tmp private and empty (a mount namespace), `python3` a Python 3.12 with the
# GPU image's packages but torch (VENV312: pip install uvloop==0.23.0
# prometheus_client==0.26.0 protobuf==7.36.2 grpcio==1.84.0 transformers==5.17.0 httpx anyio
# pyyaml rich click). Then call 1 (unpack.py) and call 2 (install.sh, gpu_device.sh): the
# preflight must pass; bench.gpu itself stops where it first needs torch (the random model).
#
#   bash bench/gpu_rehearse.sh /path/to/venv312 /path/to/out      (root: unshare -m)
set -euo pipefail
venv=${1:?a Python 3.12 virtualenv}; out=${2:?an output folder}
root=$(git rev-parse --show-toplevel)
[ -d "$root/.gpu/c1" ] && [ -d "$root/.gpu/c2" ] || { echo "no .gpu: run pack.sh first"; exit 1; }
# What a device call carries: the working tree and one of .gpu/c1, .gpu/c2, 64 MiB in all.
tree_b=$(cd "$root" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for part in c1 c2; do
  b=$((tree_b + $(du -sb "$root/.gpu/$part" | cut -f1)))
  [ "$b" -le 67108864 ] || echo "[rehearsal] the tree and .gpu/$part: $b bytes, over the 64 MiB" \
    "a device call carries: move docs/ and tests/ aside for the calls (bench/gpu_device.sh)"
done
tree=$(mktemp -d /var/tmp/gpu-rehearsal.XXXXXX)
(cd "$root" && git ls-files -z | xargs -0 cp --parents -t "$tree" && cp -r .gpu "$tree/")
rm -rf "$out" && mkdir -p "$out"
unshare -m --propagation private bash -c '
  mount -t tmpfs -o size=4g tmpfs /tmp && cd "$1" && export PATH="$2/bin:$PATH" &&
  unset PYTHONPATH VIRTUAL_ENV && python3 .gpu/c1/unpack.py &&
  source .gpu/c2/install.sh && OUT="$3" bash bench/gpu_device.sh' _ "$tree" "$venv" "$out" \
  && echo "[rehearsal] the whole bench ran" \
  || echo "[rehearsal] stopped; preflight: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["passed"])' "$out/preflight.json" 2>/dev/null || echo none)"
rm -rf "$tree"
