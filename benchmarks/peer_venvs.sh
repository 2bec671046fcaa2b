#!/usr/bin/env bash
# The bench's peers whose requirements conflict with the project's venv, each in a venv of its
# own: MosaicML Streaming (numpy < 2.2) and Google Grain. Each venv gets this project (with the
# `bench-workloads` extra: the same tokenizer, Pillow, pyarrow and webdataset as our side) and
# the peer, all installed with `-c constraints.txt` so that torch stays the pinned CPU build.
# `python benchmarks/bench_peers.py --workload llm|vision` runs a peer in its venv when the venv
# exists (default location: .venv-peers/ in the repository, or --peer-venvs DIR).
#
#   bash benchmarks/peer_venvs.sh [DIR] [PEER ...]      # PEER: streaming, grain (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
dir="${1:-$root/.venv-peers}"
shift || true
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(streaming grain)
python="${PYTHON:-python3}"

for peer in "${peers[@]}"; do
    case "$peer" in
        streaming) packages=("mosaicml-streaming==0.13.0" "numpy<2.2") ;;
        grain) packages=("grain==0.2.18") ;;
        *) echo "unknown peer '$peer' (choose from: streaming, grain)" >&2; exit 2 ;;
    esac
    venv="$dir/$peer"
    echo "== $peer -> $venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -c "$root/constraints.txt" \
        -e "$root[bench-workloads]" "${packages[@]}"
    "$venv/bin/python" -c "import torch, numpy; print('$peer: torch', torch.__version__, 'numpy', numpy.__version__)"
done
