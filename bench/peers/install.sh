#!/usr/bin/env bash
# Installs the Python peers into local virtual environments beside this script:
# - .venv         from every requirements-*.txt except requirements-offline.txt,
#                 requirements-minari_formats.txt and requirements-simglucose.txt (dp_accounting,
#                 Gymnasium 1.4, PyTorch PPO, the policy-export peer torch_policy.py, the
#                 PrivORL-n synthesizer peer synther_peer.py, TensorBoard's event reader, ...);
# - .venv-offline from requirements-offline.txt and requirements-minari_formats.txt (d3rlpy
#                 2.8.1 pins gymnasium 1.0.0, which conflicts with the other peers; minari with
#                 its hdf5 and create (jax) extras, opacus);
# - .venv-simglucose from requirements-simglucose.txt (simglucose 0.2.11 pins gymnasium 0.29.1).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

python3 -m venv "$here/.venv"
"$here/.venv/bin/pip" install --quiet --upgrade pip
for req in "$here"/requirements-*.txt; do
  [ "$(basename "$req")" = "requirements-offline.txt" ] && continue
  [ "$(basename "$req")" = "requirements-minari_formats.txt" ] && continue
  [ "$(basename "$req")" = "requirements-simglucose.txt" ] && continue
  echo "installing $(basename "$req") into .venv"
  "$here/.venv/bin/pip" install --quiet -r "$req"
done
echo "peers installed in $here/.venv"

python3 -m venv "$here/.venv-offline"
"$here/.venv-offline/bin/pip" install --quiet --upgrade pip
echo "installing requirements-offline.txt and requirements-minari_formats.txt into .venv-offline"
"$here/.venv-offline/bin/pip" install --quiet -r "$here/requirements-offline.txt" \
  -r "$here/requirements-minari_formats.txt"
echo "offline peers installed in $here/.venv-offline"

python3 -m venv "$here/.venv-simglucose"
"$here/.venv-simglucose/bin/pip" install --quiet --upgrade pip
echo "installing requirements-simglucose.txt into .venv-simglucose"
"$here/.venv-simglucose/bin/pip" install --quiet -r "$here/requirements-simglucose.txt"
echo "simglucose peer installed in $here/.venv-simglucose"
