#!/usr/bin/env bash
# The README's test command as a new user runs it: this checkout's HEAD cloned into a fresh private
# (mode-700) `mktemp -d` directory, then `bash scripts/test.sh ARGS...` there. Catches whatever only
# works because the clone sits where every user can read it (issue 40: PostgreSQL run as another user).
#   bash scripts/ci-private-clone.sh -e lint                       # as the caller (root or not)
#   bash scripts/ci-private-clone.sh --user agltest -e core -- tests/store -x
# --user NAME (root only): clone into a mode-700 directory NAME owns and run as NAME (made with useradd
# when missing). The clone is removed afterwards unless AGL_KEEP_CLONE=1. Environment passes through
# (AGL_SKIP_SYSTEM_DEPS=1 skips the apt-get step; PYTHON picks the interpreter, default python3, which
# must be one NAME can run).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
user=""
if [ "${1:-}" = "--user" ]; then
    user=${2:?--user needs a name}
    shift 2
fi
sha=$(git -C "$src" rev-parse HEAD)

if [ -n "$user" ]; then
    [ "$(id -u)" = 0 ] || { echo "ci-private-clone.sh: --user needs root" >&2; exit 2; }
    id "$user" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$user"
    home=$(getent passwd "$user" | cut -d: -f6)
    as_user=(runuser -u "$user" -- env HOME="$home" USER="$user" LOGNAME="$user")
    dir=$("${as_user[@]}" mktemp -d)
else
    as_user=()
    dir=$(mktemp -d)
fi
chmod 700 "$dir"
[ "${AGL_KEEP_CLONE:-0}" = 1 ] || trap 'rm -rf "$dir"' EXIT

# root clones (the user may not read $src), then hands the clone to the user
git clone -q --no-checkout "$src" "$dir/agl"
git -C "$dir/agl" checkout -q "$sha"
[ -z "$user" ] || chown -R "$user:" "$dir/agl"
echo "ci-private-clone.sh: $sha in $dir/agl (mode $(stat -c %a "$dir")) as ${user:-$(id -un)}" >&2

start=$(date +%s)
set +e
(cd "$dir/agl" && "${as_user[@]}" bash scripts/test.sh "$@")
rc=$?
set -e
echo "ci-private-clone.sh: exit $rc after $(( $(date +%s) - start )) s" >&2
exit $rc
