#!/usr/bin/env bash
# Run the model, rollout and learner tests against the LOWEST transformers that pyproject.toml
# allows (the highest allowed is what `make install` gets from pip). The old release goes into a
# folder of its own (pip --target) that is put first on PYTHONPATH; the venv is not changed.
#
#   bash scripts/test_transformers_bounds.sh            # uses .venv/bin/python
#
# Bounds checked: transformers 4.50.0 with tokenizers 0.21 and huggingface_hub < 1.0, which
# that release requires.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOWEST=$(grep -oE '"transformers>=[0-9.]+' pyproject.toml | head -1 | cut -d= -f2)
TARGET=${TARGET:-$(mktemp -d -t p2pnet-transformers-XXXX)}
trap 'rm -rf "$TARGET"' EXIT
echo "== installing transformers==$LOWEST into $TARGET"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$TARGET" \
    "transformers==$LOWEST" "tokenizers>=0.21,<0.22" "huggingface_hub>=0.26,<1.0"
PYTHONPATH="$TARGET:$PWD" "$PY" -c 'import transformers; print("== transformers", transformers.__version__)'
PYTHONPATH="$TARGET:$PWD" "$PY" -m pytest -q -p no:cacheprovider tests/models tests/trainer/test_model_rollout.py \
    tests/trainer/test_vllm_versions.py tests/trainer/test_learner.py tests/trainer/test_tasks.py
