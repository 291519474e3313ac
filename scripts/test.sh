#!/usr/bin/env bash
# The project's one test command (CONTRIBUTING.md; CI's .ci/run calls exactly this).
#
# Needs only python3 >= 3.10. It makes its own tool venv with tox (under .tox/, git-ignored), installs
# the system services some tests drive for real when it can (headless Chromium, PostgreSQL: only as
# root with apt-get; otherwise those tests skip and say why), then runs the tox envs:
#   bash scripts/test.sh                 # every env in tox.ini's envlist (lint, core, all, frameworks, ...)
#   bash scripts/test.sh -e lint,core    # chosen envs; any other arguments go to tox as they are
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
tools=.tox/.agl-tools
if [ ! -x "$tools/bin/tox" ]; then
    echo "scripts/test.sh: making the tool venv $tools (tox)" >&2
    "$python" -m venv "$tools"
    "$tools/bin/python" -m pip install -q --disable-pip-version-check "tox>=4.14,<5"
fi

if [ "${AGL_SKIP_SYSTEM_DEPS:-0}" != 1 ]; then
    bash scripts/system-deps.sh || echo "scripts/test.sh: system packages not installed; their tests will skip" >&2
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CREWAI_DISABLE_TELEMETRY=true CREWAI_TRACING_ENABLED=false
exec "$tools/bin/tox" "$@"
