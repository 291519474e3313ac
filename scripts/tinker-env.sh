#!/usr/bin/env bash
# The Tinker-API server environment the `tinker` tox env (and a user on a CPU) runs SkyRL's server
# from: skyrl-tx (JAX on CPU) in a venv of its own, made once. skyrl-tx pins transformers<5, which must
# not meet agl's.
#
#   bash scripts/tinker-env.sh DIR      # then: export AGL_TINKER_PYTHON=DIR/bin/python
#
# skyrl-tx's dependency `peft` would pull a CUDA torch (a 6.7 GB venv), and its `jax` extra asks for
# jax[cuda12] on Linux: skyrl-tx is installed --no-deps and its real dependencies (tinker extra, CPU
# jax) with this project's CPU torch constraint (constraints/torch.txt). The server starts its engine
# with a hard-coded `uv run ... -m tx.tinker.engine`: DIR/bin/uv is a shim that runs DIR's python, so
# a PATH with DIR/bin first is all the server needs.
set -euo pipefail
venv="${1:?usage: scripts/tinker-env.sh DIR}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac  # the uv shim names it: absolute
cd "$(dirname "$0")/.."
version="${AGL_SKYRL_TX_VERSION:-0.3.0}"
sdk="${AGL_TINKER_SDK_VERSION:-0.12.0}"   # the SDK release that speaks skyrl-tx 0.3.0's wire format
if [ -x "$venv/bin/python" ] && [ -x "$venv/bin/uv" ] \
    && "$venv/bin/python" -c "import tx.tinker.api, jax, tinker" 2>/dev/null; then
    echo "scripts/tinker-env.sh: $venv has skyrl-tx $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("skyrl-tx"))')" >&2
    exit 0
fi
# the base interpreter, not a tox/venv one (a venv made from a venv would share its site-packages path)
python="$(python3 -c 'import sys; print(sys._base_executable)')"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints/torch.txt)
"${pip[@]}" --no-deps "skyrl-tx==$version"
"${pip[@]}" "datasets>=4.0.0" "pillow>=11.3.0" "rich>=14.1.0" "safetensors>=0.6.2" "tokenizers>=0.21.2" \
    "transformers>=4.56.1,<5" "typer>=0.17.4" peft hf_transfer "cloudpathlib>=0.23.0" \
    "tinker==$sdk" "fastapi[standard]" sqlmodel "sqlalchemy[asyncio]" aiosqlite asyncpg psycopg2-binary alembic \
    "jax>=0.8,<1.0" "flax>=0.12.2" "optax>=0.2.5" torch
# the `uv run [--extra X]... -m MODULE ARGS` the server spawns its engine with, run by this venv's python
cat > "$venv/bin/uv" <<SHIM
#!/usr/bin/env bash
# agl's shim for skyrl-tx: 'uv run [--extra X]... ARGS' -> this venv's python ARGS
[ "\${1:-}" = run ] || { echo "uv shim: only 'uv run' is supported" >&2; exit 2; }
shift
while [ "\$#" -gt 0 ]; do
    case "\$1" in
        --extra|--with|--group) shift 2 ;;
        --extra=*|--with=*|--group=*|--no-sync|--frozen|--locked) shift ;;
        *) break ;;
    esac
done
exec "$venv/bin/python" "\$@"
SHIM
chmod +x "$venv/bin/uv"
"$venv/bin/python" -c "import tx.tinker.api, tx.tinker.engine, jax, tinker" >/dev/null
echo "scripts/tinker-env.sh: skyrl-tx $version (tinker SDK $sdk) ready in $venv" >&2
