#!/usr/bin/env bash
# Installs the Gymnasium bridge's Python side (python/fedrl_bridge) into the project virtual
# environment .venv-bridge/ (git-ignored) with the pinned versions of python/requirements.txt,
# then runs its tests. The client agent uses .venv-bridge/bin/python unless a scenario's
# `task.gymnasium.python` or FEDRL_PYTHON names another interpreter.
#
#   scripts/install-python-bridge.sh            classic control (CartPole, Acrobot, ...)
#   scripts/install-python-bridge.sh --extra    also Box2D (LunarLander) and MuJoCo
#
# Needs python3 >= 3.10 with the venv module. Idempotent: re-running only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="${FEDRL_BRIDGE_VENV:-$root/.venv-bridge}"
py="${PYTHON:-python3}"
if ! "$py" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
    echo "install-python-bridge: $py is missing or older than 3.10" >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r python/requirements.txt
if [ "${1:-}" = "--extra" ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r python/requirements-extra.txt
fi
# The package itself: a .pth file pointing at the repository's python/ folder, so that the
# worker the agent runs is always this checkout's (no copy to go stale).
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$root/python" > "$site/fedrl_bridge.pth"
"$venv/bin/python" -c 'import fedrl_bridge.worker, gymnasium; print("fedrl_bridge ready: gymnasium", gymnasium.__version__)'
"$venv/bin/python" -m pytest -q python/tests
