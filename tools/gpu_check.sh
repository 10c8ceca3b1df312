#!/usr/bin/env bash
# The GPU path in one command: every test marked `cuda` (NCCL groups, CUDA buckets, fddp.Cast on
# CUDA, PowerSGD and ZeRO on CUDA, a pure-NCCL group, a compiled CUDA step, the fused optimizer
# kernels against torch.optim(fused=True), CUDA checkpoints), with what ran and what was skipped.
#
#   pip install torch            # a CUDA build of torch, then, from the repository root:
#   pip install -e ".[test]"
#   bash tools/gpu_check.sh      # extra arguments go to pytest, e.g. -x or -k fused
#
# Without CUDA every test is skipped with its reason and the script exits 0: it still shows what
# a GPU machine would run. With CUDA, it exits with pytest's status. tests/test_cuda.py launches
# tests/cuda_checks.py under torchrun with one rank per GPU (at most two).
set -uo pipefail
cd "$(dirname "$0")/.."

python - <<'EOF'
import torch
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}  {torch.cuda.get_device_name(i)}")
if torch.cuda.is_available():
    print(f"  NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
else:
    print("no CUDA device: every test below is skipped, with its reason")
EOF

echo "running: python -m pytest -m cuda -v -rs -p no:cacheprovider tests $*"
python -m pytest -m cuda -v -rs -p no:cacheprovider tests "$@" | tee /tmp/gpu_check.$$.log
status=${PIPESTATUS[0]}

ran=$(grep -cE "::.* PASSED|::.* FAILED|::.* ERROR" /tmp/gpu_check.$$.log)
skipped=$(grep -cE "::.* SKIPPED" /tmp/gpu_check.$$.log)
failed=$(grep -cE "::.* (FAILED|ERROR)" /tmp/gpu_check.$$.log)
rm -f /tmp/gpu_check.$$.log
echo "gpu_check: ${ran} ran (${failed} failed), ${skipped} skipped"
if [ "$status" -eq 5 ]; then
    echo "gpu_check: pytest collected no test marked cuda" >&2
    exit 5
fi
exit "$status"
