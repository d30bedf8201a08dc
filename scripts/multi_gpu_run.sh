#!/usr/bin/env bash
# The multi-GPU run, on a machine with two or more GPUs of one host, from the repository root:
#     bash scripts/multi_gpu_run.sh [OUT [STEP ...]]   (OUT: results folder, default benchmarks/results)
# Runs the steps named (default: all, in this order; each fits the device tool's 10-minute call), and keeps
# going when one fails (the summary at the end says which):
#   conformance    `torchhal conformance --profile full` (the two-device clauses apply);
#   tp_8b          tensor parallel, the 8B shape at TP 1, 2 (and 4 with four GPUs);
#   tp_70b         the 70B shape (seeded random weights built on the devices) at TP 2 (4 with four GPUs);
#   collectives    a decode step's collectives alone, captured in a graph (8B and 70B shapes, each TP size);
#   ipc_transport  the IPC transport benchmark (producer on GPU 0, consumers on GPU 1);
#   pytest_gpu     `pytest -m "gpu or multi_gpu"`.
# NVLink multicast stays off (the lending machines require it).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${1:-benchmarks/results}
shift $(( $# > 0 ? 1 : 0 ))
steps=${*:-conformance tp_8b tp_70b collectives ipc_transport pytest_gpu}
mkdir -p "$out"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
    echo "multi_gpu_run: $gpus GPU(s) visible; this run needs two or more" >&2
    exit 2
fi
tp_sizes="1 2"; big_tp=2; group_sizes="2"
if [ "$gpus" -ge 4 ]; then tp_sizes="1 2 4"; big_tp=4; group_sizes="2 4"; fi
failed=()
step() {  # step NAME COMMAND...: when NAME is asked for, run, log to $out/NAME.log, remember a failure
    local name=$1; shift
    case " $steps " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name: $*"
    if ! "$@" >"$out/$name.log" 2>&1; then failed+=("$name"); fi
    tail -n 25 "$out/$name.log"
}
step conformance torchhal conformance --profile full --json "$out/conformance_${gpus}xh200.json"
# --timeout bounds each TP size's launch: a hung rank is stopped and its Python stacks are in the log.
step tp_8b python benchmarks/tensor_parallel.py --shape 8b --tp $tp_sizes --timeout 240 --out "$out"
step tp_70b python benchmarks/tensor_parallel.py --shape 70b --tp $big_tp --cells 32x1 32x8 32x32 --timeout 240 \
    --out "$out"
step collectives bash -c "python benchmarks/collective_latency.py --tp $group_sizes --out $out \
    && python benchmarks/collective_latency.py --tp $group_sizes --shape 70b --out $out"
step ipc_transport python benchmarks/ipc_transport.py --out "$out"
step pytest_gpu python -m pytest -m "gpu or multi_gpu" -q
echo "== failed steps: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
