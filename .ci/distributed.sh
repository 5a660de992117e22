#!/usr/bin/env bash
# CI step: the slow tests of models split across processes and of the Ray engine (pytest marker `distributed`, left
# out of the normal suite). Installs the `ray` extra into the given environment, then runs
#   tests/test_distributed.py  torchrun --nproc_per_node 2 (gloo, CPU): tensor-, pipeline- and FSDP2-sharded models
#   tests/test_ray_scan.py     a local Ray cluster (ray.init(num_cpus=2)): scan(engine="ray") and ScanBatches
# Usage: bash .ci/distributed.sh [VENV]   (default .venv; run from anywhere). About 3 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
start=$SECONDS
"$venv/bin/python" -m pip install -q -e ".[ray]"
"$venv/bin/python" -c "import ray, torch, transformers; print('ray', ray.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
export RAY_AUTH_MODE=disabled  # a local test cluster: no token written under the home folder
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m distributed --durations=10 tests/test_distributed.py tests/test_ray_scan.py
echo "distributed step passed in $((SECONDS - start)) s"
