#!/usr/bin/env bash
# Run the Hugging Face integration tests against the OLDEST transformers release pyproject.toml admits
# (transformers>=5.0), beside the pinned one that scripts/setup.sh installs.
#
#   bash scripts/test_oldest.sh            # after scripts/setup.sh; extra pytest arguments are passed on
#
# transformers 5.0.0 (and the tokenizers release it accepts, <=0.23.0) go into .oldest/ and shadow the
# venv's copies through PYTHONPATH; nothing in .venv changes. The tests chosen are those whose behaviour depends on
# transformers: the attention hook and its errors, the fused loss on each model type, sliding-window / soft-capped
# models, packed documents (transformers' own packed-sequence rule on one device). torch and lightning are tested
# at their pinned versions only (the CPU wheel on disk is torch 2.13.0; the GPU image runs torch 2.11).
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=.oldest
if [ ! -f "$OLDEST/transformers/__init__.py" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$OLDEST" \
    "transformers==5.0.0" "tokenizers==0.22.2"
fi
PYTHONPATH="$PWD/$OLDEST${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python - <<'EOF'
import transformers
assert transformers.__version__ == "5.0.0", transformers.__version__
print("oldest supported transformers:", transformers.__version__, "from", transformers.__file__)
EOF
PYTHONPATH="$PWD/$OLDEST${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/unit/test_hf.py tests/unit/test_fused_loss_models.py tests/distributed/test_variant_models.py \
  "tests/distributed/test_packed_documents.py::test_packed_batch_trains_like_its_documents_one_by_one" \
  "tests/distributed/test_packed_documents.py::test_documents_matter_for_the_model" \
  "tests/distributed/test_packed_documents.py::test_one_device_packed_inputs_that_transformers_would_ignore_are_clear_errors" \
  "tests/distributed/test_packed_documents.py::test_document_starts_follow_transformers_rule" "$@"
