#!/usr/bin/env bash
# Bring your own data (issue 58, "Checked by"): Python minari writes one small CartPole dataset in
# each of its storage formats (hdf5, arrow, parquet) with DataCollector, `fedrl data import`
# reads each (HDF5 only in a build with the `hdf5` feature; otherwise the refusal and its hint
# are shown), a short `fedrl cql` trains on the imported parquet one, and d3rlpy 2.8.1 loads a
# dataset `fedrl data generate` wrote, with Minari's termination and truncation flags as they
# are (bench/peers/minari_formats.py). Result: bench/results/minari_formats.json and stdout.
# Usage: [FEDRL=path/to/fedrl] [FEATURES=hdf5] [ROOT=dir] bench/run_minari_formats.sh
#        (FEDRL unset: a release build, with --features "$FEATURES" when set; the hdf5 feature
#        links the system libhdf5: `apt-get install libhdf5-dev`)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="$root/bench/peers/.venv-offline/bin/python"
[ -x "$py" ] || { echo "run bench/peers/install.sh first (minari[create], d3rlpy in .venv-offline)"; exit 1; }
if [ -z "${FEDRL:-}" ]; then
  cargo build --release -q -p fedrl-scenarios ${FEATURES:+--features "$FEATURES"}
  FEDRL="$root/target/release/fedrl"
fi
data="${ROOT:-$(mktemp -d -t fedrl-minari-formats.XXXXXX)}"
mkdir -p "$data"
uptime
"$py" bench/peers/minari_formats.py --root "$data" --fedrl "$FEDRL" \
  --out "$root/bench/results/minari_formats.json" 2> "$data/peer.log" \
  || { tail -30 "$data/peer.log"; exit 1; }
echo "datasets in $data"
