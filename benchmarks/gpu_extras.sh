#!/usr/bin/env bash
# Here, after ../shared/gpu/prepare.sh: adds the pytest-xdist and execnet wheels to .gpu/fi, so
# that .gpu/fi/install.sh installs them on the GPU machine with FlashInfer and
# benchmarks/canonical_h200.sh runs its CUDA tests over 8 workers (serially, part 3's suite ran
# out of its 360 s in sessions 12-13; under xdist it took 244 s in session 14).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .gpu/fi ] || { echo "no .gpu/fi: run bash ../shared/gpu/prepare.sh first"; exit 1; }
python3 -m pip download -q --no-deps pytest-xdist==3.8.0 execnet==2.1.2 -d .gpu/fi
ls .gpu/fi
