#!/usr/bin/env bash
# System packages that some tests drive for real, installed from Debian's archive when this machine can
# (root with apt-get). Installs nothing that is already there; exits non-zero when it cannot install.
#   chromium, chromium-driver  the dashboard's browser tests (headless)
#   postgresql                 the PostgreSQL store's conformance suite (a throwaway server per test run)
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/system-deps.sh: missing ${need[*]} (install them as root with apt-get)" >&2
    exit 1
fi
echo "scripts/system-deps.sh: apt-get install ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
