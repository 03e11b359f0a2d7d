#!/usr/bin/env bash
# Stage what scripts/gpu_check.sh needs on a lent GPU machine, here, before the first device call.
#
# The device machine gets this repository and nothing beside it, and cannot reach PyPI: its image
# has torch, triton, numpy, tiktoken, safetensors, pyyaml and tqdm, but not Hydra, and
# ../shared/anchors/nanoGPT does not travel. This copies nanoGPT and the missing packages' wheels
# into .gpu/ (ignored by .gitignore), and prints the one device command that
# carries .gpu and runs the whole check: the lent minutes then go to measuring, not to setup.
#
# Usage, from anywhere: scripts/gpu_stage.sh [DIR]   (DIR: .gpu in the repository, the default)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python}
NANOGPT=${NANOGPT:-$ROOT/../shared/anchors/nanoGPT}
DIR=${1:-.gpu}

[[ -f $NANOGPT/bench.py ]] || { echo "gpu_stage: no nanoGPT bench.py in $NANOGPT; set NANOGPT" >&2; exit 2; }
rm -rf "$DIR" && mkdir -p "$DIR/whl"
cp -r "$NANOGPT" "$DIR/nanoGPT"
# Pure-Python packages, so a wheel built here installs on the device's Python 3.12 as well
# (antlr4's runtime 4.9.3, Hydra's pin, is published as a source archive only).
"$PYTHON" -m pip wheel --quiet --no-deps -w "$DIR/whl" \
  hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
# The server and pytest, for gpu_check.sh's isolation step, at the versions installed here, as
# the device's CPython 3.12 on x86-64 Linux takes them (pydantic-core is compiled).
SERVER=(fastapi starlette pydantic pydantic-core uvicorn h11 anyio sniffio annotated-types
        typing-inspection typing-extensions click idna pytest pluggy iniconfig packaging)
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 -d "$DIR/whl" \
  $("$PYTHON" -c 'import sys, importlib.metadata as m; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${SERVER[@]}")
du -sh "$DIR" | sed 's/^/staged: /'

cat << 'EOF'
device command (run(command=..., carry=[".gpu"], timeout_s=600)):
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site PYTHON=python3 NANOGPT=.gpu/nanoGPT PYTHONUNBUFFERED=1 && scripts/gpu_check.sh $OUT/gpu
EOF
