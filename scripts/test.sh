#!/usr/bin/env bash
# The project's one test command (CONTRIBUTING.md; CI's .ci/run calls exactly this).
#
# Needs only python3 >= 3.10. It makes its own tool venv with tox (under .tox/, git-ignored), installs
# the system services some tests drive for real when it can (headless Chromium, PostgreSQL: only as
# root with apt-get; otherwise those tests skip and say why), then runs the tox envs:
#   bash scripts/test.sh                 # every env in tox.ini's envlist (all, lint, core, frameworks, ...), two at a time
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
if [ "$#" -eq 0 ]; then
    # the whole matrix, two envs at a time (tox.ini's envlist and `depends` say which run together);
    # each env's output streams as it runs (--parallel-live: two envs' lines interleave), and the exit
    # status is non-zero if any env failed
    exec "$tools/bin/tox" run-parallel --parallel 2 --parallel-live --parallel-no-spinner
fi
exec "$tools/bin/tox" "$@"
