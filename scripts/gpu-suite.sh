#!/usr/bin/env bash
# The GPU test and benchmark suite, run from a checkout on a CUDA machine: the GPU-marked tests
# and the benchmarks, logs under $OUT (default ./out). Usage: bash scripts/gpu-suite.sh STAGE...
# with stages:
#   tests-kda tests-mla tests-moe tests-runtime tests-engine-gpu tests-cache tests-all
#   tests-spec tests-fp8
#   bench-kda bench-mla bench-moe bench-attnres decode-step offline parity
#   bench-spec decode-step-fp8 moe-host
#   pd-transfer (two GPUs)
# STAGE_TIMEOUT=SECONDS bounds each stage: the stage's own process is killed at the limit (a
# `timeout` around this whole script would kill only the shell and leave the stage's python
# running on the GPU beside whatever runs next).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="src:benchmarks:${PYTHONPATH:-}"
status=0
run() {  # run NAME CMD...: log to $out/NAME.log, remember failures, keep going
    local name=$1
    shift
    echo "=== $name: $*"
    local start=$SECONDS
    local limit=()
    [ -n "${STAGE_TIMEOUT:-}" ] && limit=(timeout -s KILL "$STAGE_TIMEOUT")
    "${limit[@]}" "$@" 2>&1 | tee "$out/$name.log" | tail -n 40
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for stage in "$@"; do
    case "$stage" in
        tests-kda) run tests-kda python3 -m pytest -q -m gpu tests/model/ops/test_kda_decode.py \
            tests/model/ops/test_kda_prefill.py tests/model/ops/test_kda_tail.py ;;
        tests-mla) run tests-mla python3 -m pytest -q -m gpu tests/model/ops/test_mla_decode.py \
            tests/model/ops/test_mla_gluon_decode.py tests/model/ops/test_mla_gluon_convert.py \
            tests/model/ops/test_mla_prefill.py ;;
        tests-moe) run tests-moe python3 -m pytest -q -m gpu tests/model/ops/test_moe_gate.py \
            tests/model/ops/test_moe_experts.py tests/model/ops/test_mxfp4.py \
            tests/model/ops/test_moe_gluon_fp8.py \
            tests/model/ops/test_attn_res_fused.py ;;
        tests-runtime) run tests-runtime python3 -m pytest -q tests/runtime ;;
        tests-engine-gpu) run tests-engine-gpu python3 -m pytest -q -m gpu tests/runtime \
            tests/model/test_kernel_paths_gpu.py ;;
        tests-cache) run tests-cache python3 -m pytest -q tests/cache -k "gpu or storage or load" ;;
        tests-all) run tests-all python3 -m pytest -q -m "gpu" tests ;;
        tests-spec) run tests-spec python3 -m pytest -q -m gpu tests/runtime/test_spec_gpu.py ;;
        tests-fp8) run tests-fp8 python3 -m pytest -q -ra -m gpu tests/runtime/test_fp8_gpu.py \
            tests/model/layers/test_fp8_linear_gpu.py ;;
        bench-kda)
            run bench-kda-decode python3 benchmarks/kda_decode.py --out "$out/kda_decode.md"
            run bench-kda-prefill python3 benchmarks/kda_prefill.py --out "$out/kda_prefill.md"
            run bench-kda-tail python3 benchmarks/kda_tail.py --out "$out/kda_tail.md" ;;
        bench-mla) run bench-mla python3 benchmarks/mla_decode.py --out "$out/mla_decode.md" ;;
        bench-moe) run bench-moe python3 benchmarks/moe.py --out "$out/moe.md" ;;
        bench-attnres) run bench-attnres python3 benchmarks/attn_res.py --out "$out/attn_res.md" ;;
        decode-step) run decode-step python3 benchmarks/decode_step.py --out "$out/decode_step.md" ;;
        offline) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
            run offline python3 benchmarks/offline.py --out "$out/offline.md" ;;
        parity) run parity python3 benchmarks/kimi_linear_parity.py --out "$out/parity.md" ;;
        bench-spec)
            run bench-spec-verify python3 benchmarks/spec_verify.py --out "$out/spec_verify.md"
            run bench-spec-decode python3 benchmarks/spec_decode.py --out "$out/spec_decode.md" ;;
        decode-step-fp8) run decode-step-fp8 python3 benchmarks/decode_step.py --compare-fp8 \
            --out "$out/decode_step_fp8.md" ;;
        moe-host) run moe-host python3 benchmarks/moe_host.py --breakdown ;;
        pd-transfer) run pd-transfer python3 benchmarks/pd_transfer.py --out "$out/pd_transfer.md" ;;
        *) echo "unknown stage $stage"; status=1 ;;
    esac
done
exit $status
