#!/usr/bin/env bash
# The wheels of realhf's runtime dependencies that a bare GPU host lacks, for its Python 3.12 on
# x86-64 Linux, fetched here from the package index (the host has no network):
#
#   bash tools/gpu_wheels.sh [--have FILE] [--dest DIR]
#
# FILE is the host's `pip list` or `pip freeze`; without it, the packages of the lent GPU image
# (HOST_HAS below). The requirements are setup.py's install_requires
# (`python benchmark/gpu_check.py --requirements`); those the host has are left out, and its
# versions constrain what the rest depend on. Their wheels, and those of their own dependencies
# the host lacks, go to DIR (default .gpu_wheels/, git-ignored); benchmark/gpu_check.sh installs
# them with `pip install --no-index --no-deps --target` and puts that folder on PYTHONPATH.
# The working tree travels with them within 64 MiB: the script fails if they do not fit.
# torch is the host's own CUDA build and never fetched; Ray, wandb, vLLM, SGLang and etcd are
# optional extras of setup.py and are not fetched either.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.gpu_wheels
HAVE_FILE=""
LIMIT_MIB=64
while [ $# -gt 0 ]; do
  case "$1" in
    --have) HAVE_FILE=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

# The lent GPU image ('cuda'), as read on 2026-11-17; versions where they were read.
HOST_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub==1.33.0 humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy==2.5.2 numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors==0.8.0 scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers==0.23.2 toolz torch==2.11.0 torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers==5.17.0 treescope triton==3.6.0
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
norm() { tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g'; }

# The host's packages as `name==version` (or `name`): pip list, pip freeze, or HOST_HAS.
if [ -n "$HAVE_FILE" ]; then
  awk '/^(Package|---|#|-e )/ {next}
       $0 ~ /==/ {split($1, a, "=="); print a[1] "==" a[3]; next}
       $0 ~ / @ / {print $1; next}
       NF >= 2 && $2 ~ /^[0-9]/ {print $1 "==" $2; next}
       NF >= 1 {print $1}' "$HAVE_FILE" | sed -E 's/==$//' >"$TMP/have.txt"
else
  tr ' ' '\n' <<<"$HOST_HAS" | grep . >"$TMP/have.txt"
fi
cut -d= -f1 "$TMP/have.txt" | norm | sort -u >"$TMP/have_names.txt"
# Its versions pin what the fetched packages depend on (local versions such as +cu130 are
# not on the index, and need no pin: the host's own wheel is never fetched).
grep '==' "$TMP/have.txt" | grep -v '+' >"$TMP/constraints.txt" || true

WANT=()
while read -r req; do
  name=$(sed -E 's/[ <>=!~;\[].*//' <<<"$req" | norm)
  if [ "$name" = torch ]; then
    echo "never     $req (the host's own CUDA build: a GPU host without torch cannot be checked)"
  elif grep -qx "$name" "$TMP/have_names.txt"; then
    echo "host has  $req"
  else
    echo "fetch     $req"
    WANT+=("$req")
  fi
done < <("$PY" benchmark/gpu_check.py --requirements)
echo "not fetched: ray, wandb, vllm, sglang, etcd-sdk-python (optional extras of setup.py)"

PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 5 12 17 24 26 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")

mkdir -p "$DEST" "$TMP/all" "$TMP/local"
rm -f "$DEST"/*.whl
if [ ${#WANT[@]} -gt 0 ]; then
  # hydra-core and omegaconf pin antlr4-python3-runtime 4.9.*, published only as source; it is
  # pure Python, so a wheel built here installs on any Python 3.
  if ! grep -qx antlr4-python3-runtime "$TMP/have_names.txt"; then
    "$PY" -m pip wheel -q --no-deps -w "$TMP/local" antlr4-python3-runtime==4.9.3
    echo "antlr4-python3-runtime==4.9.3" >>"$TMP/constraints.txt"
  fi
  "$PY" -m pip download -q "${TARGET[@]}" --find-links "$TMP/local" \
    -c "$TMP/constraints.txt" -d "$TMP/all" "${WANT[@]}"
fi

for whl in "$TMP"/all/*.whl; do
  [ -e "$whl" ] || continue
  name=$(basename "$whl" | cut -d- -f1 | norm)
  grep -qx "$name" "$TMP/have_names.txt" || mv "$whl" "$DEST/"
done
dups=$(ls "$DEST" | cut -d- -f1 | norm | sort | uniq -d)
[ -z "$dups" ] || { echo "gpu_wheels.sh: two versions of: $dups" >&2; exit 1; }

# What travels to the host: the tracked files and these wheels, 64 MiB together.
tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {printf "%d", s}')
wheels=$(find "$DEST" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {printf "%d", s}')
ls -S "$DEST" | sed 's/^/  /'
echo "$(ls "$DEST" | wc -l) wheels, $((wheels / 1024)) KiB in $DEST; the tracked files $((tree / 1048576)) MiB"
if [ $((tree + wheels)) -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_wheels.sh: over the ${LIMIT_MIB} MiB that travel; pass --have with the host's pip list" >&2
  exit 1
fi

# They must install for that Python with nothing else: the check installs them so. (The
# download already chose them for Python 3.12; pip would test Requires-Python against this one.)
if compgen -G "$DEST/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --ignore-requires-python "${TARGET[@]}" \
    --target "$TMP/site" "$DEST"/*.whl
  echo "they install for CPython 3.12 (pip install --no-index --no-deps --target)"
fi
