#!/usr/bin/env bash
# Stage what the GPU check's device run carries, under .gpu/ (git-ignored), then print the two calls.
#
#   bash scripts/prepare_gpu_call.sh        # here, with registry access (a few minutes: xz -9)
#
# The device machine has no registry and a call carries at most 64 MiB, so MLX's CUDA build
# travels in two parts (../shared/gpu/pack_mlx_cuda.sh): call 1 stashes partaa on the machine,
# call 2 (within ~30 s, while it is warm) carries partab, the dependency wheels and
# device_install.sh, and runs scripts/device_gpu_check.sh. extra/ holds the server's
# dependencies that neither the machine's image (../.library/device/KINDS.md) nor deps/ has.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=.gpu
SHARED=../shared/gpu
mkdir -p "$GPU/extra"
if [ ! -s "$GPU/partaa" ] || [ ! -s "$GPU/partab" ] || [ ! -d "$GPU/deps" ]; then
    bash "$SHARED/pack_mlx_cuda.sh" "$GPU"
fi
cp "$SHARED/device_install.sh" "$GPU/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$GPU/extra" \
    "pydantic-settings>=2.3" python-dotenv "platformdirs>=4" "llguidance>=1.9,<2" \
    "httptools>=0.6"

# What each call sends: the working tree (tracked and not ignored) plus what it carries.
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
call1=$(du -cb "$GPU/partaa" | tail -1 | cut -f1)
call2=$(du -cb "$GPU/partab" "$GPU/deps" "$GPU/extra" "$GPU/device_install.sh" | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
for pair in "1:$call1" "2:$call2"; do
    n=${pair%%:*}; bytes=$((tree + ${pair#*:}))
    echo "call $n sends $((bytes / 1024 / 1024)) MiB of 64"
    [ "$bytes" -lt "$limit" ] || { echo "call $n is over the limit" >&2; exit 1; }
done
rev=$(git rev-parse --short HEAD)
cat <<EOF
Staged in $GPU/. Check that .gpu is git-ignored (git status shows nothing under it), then,
back to back (the machine stays warm ~30 s after a call):
  run 1: carry [".gpu/partaa"]
         command: mkdir -p /root/stash && cp .gpu/partaa /root/stash/
  run 2: carry [".gpu/partab", ".gpu/deps", ".gpu/extra", ".gpu/device_install.sh"]
         command: bash scripts/device_gpu_check.sh $rev     (timeout_s 600)
Results come back under \$OUT: results.json (ours and mlx_lm.server), results_ab_previous.json,
results_write_back.json, results_compiled_decode.json, bench.log, checks.log. Then give_back.
EOF
