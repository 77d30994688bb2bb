#!/usr/bin/env bash
# The GPU check: the single command of the SECOND device call (H200, no network).
#
#   bash scripts/device_gpu_check.sh [REVISION [BENCHMARK ARGS...]]   # e.g. abc1234 --max-batch 64
#
# Expects, carried with the call (all git-ignored under .gpu/): partab, deps/*.whl,
# device_install.sh (a copy of ../shared/gpu/device_install.sh) and extra/*.whl (the server's
# pure-Python dependencies the image lacks); partaa was stashed in /root/stash/ by the first
# call. scripts/prepare_gpu_call.sh stages all of it here and prints both calls.
# Installs MLX's CUDA build, then runs benchmark_scripts/benchmark_gpu.py under a time
# limit that keeps the whole call inside ~570 s. REVISION (the commit the tree was copied from;
# the device copy has no git) is recorded in the results; later arguments go to the benchmark.
# SKIP_TESTS=1 leaves out the CUDA-side pytest run at the end (a rerun of the figures alone).
# Writes into $OUT (what comes back): results.json, bench.log, install.log, logs/*.log, and,
# when time is left, results_ab_previous.json (ours with compiled decode and write-back off),
# results_write_back.json and results_compiled_decode.json (in-process decode-step probes).
# Not `set -e`: a failed phase must not stop the later ones (results are written as they come).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
REVISION=${1:-unknown}
shift || true
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# Models build into a scratch home, never the copied tree (nothing of it needs to come back).
export VELOXQUANT_HOME
VELOXQUANT_HOME=$(mktemp -d /tmp/veloxquant-home.XXXXXX)
# No network: no library should even try a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== install MLX CUDA ($(date -u +%T))"
timeout 180 bash .gpu/device_install.sh .gpu 2>&1 | tee "$OUT/install.log"
echo "install exit ${PIPESTATUS[0]} after $((SECONDS - START)) s"

# Only wheels whose distribution is missing: reinstalling one the image already has
# (click under typer, say) could swap a version other packages were pinned against.
for whl in .gpu/extra/*.whl; do
    [ -e "$whl" ] || continue
    dist=$(basename "$whl" | cut -d- -f1)
    if python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" \
            2>/dev/null; then
        echo "extra: $dist already installed, kept"
    else
        python3 -m pip install -q --no-deps --no-index "$whl" 2>&1 | tee -a "$OUT/install.log"
        echo "extra: installed $(basename "$whl")"
    fi
done
python3 -c "import fastapi, uvicorn, pydantic_settings, dotenv, platformdirs, prometheus_client, \
tokenizers, transformers, mlx_lm; print('server imports ok')" 2>&1 | tee -a "$OUT/install.log"

echo "== GPU"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

# Why the server leaves through os._exit after its drain (server/__main__.py): the
# same MLX work done on a worker thread, then a normal interpreter exit vs os._exit.
for how in normal os_exit; do
    timeout 60 python3 - "$how" >"/tmp/exit_$how.log" 2>&1 <<'PY'
import os, sys, threading, mlx.core as mx
def work():
    a = mx.random.normal((2048, 2048)).astype(mx.bfloat16)
    for _ in range(50):
        a = (a @ a) / 2048
    mx.eval(a)
    mx.synchronize()
t = threading.Thread(target=work); t.start(); t.join()
print("worker done", flush=True)
if sys.argv[1] == "os_exit":
    os._exit(0)
PY
    echo "mlx exit after worker-thread GPU work, $how: exit $? $(tr '\n' ' ' <"/tmp/exit_$how.log" | tail -c 300)" | tee -a "$OUT/checks.log"
done

echo "== CUDA-side tests: device naming, backend detection, SIGTERM drain"
PYTHONPATH=$(pwd) timeout 60 python3 - <<'PY' 2>&1 | tee -a "$OUT/checks.log"
import sys
from veloxquant_mlx.mlx_device import _libmlx_path, elf_needed, gpu_expected, mlx_build
build = mlx_build()
print("libmlx:", _libmlx_path(), [n for n in elf_needed(_libmlx_path()) or [] if "cu" in n])
print("build:", build, "gpu_expected:", gpu_expected(), "mlx.core imported:", "mlx.core" in sys.modules)
import mlx.core as mx
from veloxquant_mlx.cpu_backend import describe_backend
from server.model_weights import plan_weights
print("device_info:", mx.device_info())
print("backend:", describe_backend("bfloat16"))
on_gpu = mx.default_device().type == mx.DeviceType.gpu
print("auto, float32 checkpoint:", plan_weights("auto", on_gpu, False, 0, 0, stored_dtype="float32"))
PY
# The benchmark gets what is left of ~480 s (at most 330 s); it shares out its own
# --budget-s (35 s less, kept for its last stop and the step profile) and writes results as
# it goes, so the outer timeout only ever cuts a run that went wrong.
LEFT=$((480 - (SECONDS - START)))
BENCH_T=$((LEFT < 330 ? LEFT : 330))
echo "== benchmark: timeout ${BENCH_T} s, budget $((BENCH_T - 35)) s ($(date -u +%T))"
PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd) timeout -k 15 "$BENCH_T" python3 \
    benchmark_scripts/benchmark_gpu.py --out "$OUT/results.json" --log-dir "$OUT/logs" \
    --budget-s $((BENCH_T - 35)) --revision "$REVISION" "$@" 2>&1 | tee "$OUT/bench.log"
echo "benchmark exit ${PIPESTATUS[0]} after $((SECONDS - START)) s"

# An A/B of one host-side choice, when time is left: by default ours alone with events sent
# at once (a step's events sent as soon as they are ready, not at the next submit), same
# model and load. SKIP_AB=1 leaves it out; AB_FLAGS picks another A/B ("--unfused-projections",
# "--uncompiled-decode --kv-write-back 1" for mlx-lm's blocks as written and the KV
# written every step, or "--mlx-env MLX_MAX_OPS_PER_BUFFER=120" for CUDA graphs of 120
# kernels instead of MLX's 30 on an H100/H200).
AB_FLAGS=${AB_FLAGS:---events-at-once}
AB_T=$((510 - (SECONDS - START)))
if [ -z "${SKIP_AB:-}" ] && [ "$AB_T" -ge 100 ]; then
    echo "== A/B: ours with $AB_FLAGS, timeout ${AB_T} s"
    PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd) timeout -k 15 "$AB_T" python3 \
        benchmark_scripts/benchmark_gpu.py --out "$OUT/results_ab_previous.json" \
        --log-dir "$OUT/logs_ab" --budget-s $((AB_T - 25)) --reserve-s 30 --revision "$REVISION" \
        "$@" --ours-only $AB_FLAGS 2>&1 | tee "$OUT/bench_ab.log"
    echo "A/B exit ${PIPESTATUS[0]} after $((SECONDS - START)) s"
fi

# In-process probes of the 1b model's decode step (no server), when time is left: write-back
# 1 vs 32 (with what one arena write costs) and compiled vs written blocks. Their synced steps
# split a step into host time and device time: which of the two bounds a step on this GPU.
# SKIP_PROBES=1 leaves them out.
PROBE_T=$((450 - (SECONDS - START)))
if [ -z "${SKIP_PROBES:-}" ] && [ "$PROBE_T" -ge 60 ]; then
    echo "== decode-step probes, ${PROBE_T} s ($(date -u +%T))"
    PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd) timeout -k 10 $((PROBE_T / 2)) python3 \
        benchmark_scripts/benchmark_write_back.py --preset 1b --rows 1 16 64 --steps 40 \
        --rounds 1 --n-blocks 65536 --out "$OUT/results_write_back.json" 2>&1 \
        | tee "$OUT/probe_write_back.log"
    PROBE_T=$((450 - (SECONDS - START)))
    [ "$PROBE_T" -ge 20 ] && PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd) timeout -k 10 "$PROBE_T" \
        python3 benchmark_scripts/benchmark_compiled_decode.py --models 1b --rows 1 16 64 \
        --steps 30 --rounds 1 --out "$OUT/results_compiled_decode.json" 2>&1 \
        | tee "$OUT/probe_compiled.log"
    echo "probes done after $((SECONDS - START)) s"
fi

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

TEST_T=$((570 - (SECONDS - START)))
[ -n "${SKIP_TESTS:-}" ] && TEST_T=0  # a rerun of the figures alone
[ "$TEST_T" -gt 0 ] && PYTHONPATH=$(pwd) timeout $((TEST_T > 30 ? TEST_T : 30)) python3 -m pytest -q -p no:cacheprovider tests/test_mlx_env.py tests/e2e/test_drain.py \
    tests/test_mlx_device.py tests/server/test_model_weights.py tests/engine/test_batch_sampling.py \
    tests/test_compiled_decode.py tests/test_fused_projections.py tests/memory/test_maskless_decode.py \
    tests/engine/test_event_timing.py \
    2>&1 | tail -25 | tee -a "$OUT/checks.log"
rm -f "$OUT/results.tmp"  # a half-written copy, only if the run was cut mid-save
ls -la "$OUT" "$OUT/logs" 2>/dev/null
echo "total $((SECONDS - START)) s"
