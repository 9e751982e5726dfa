#!/usr/bin/env bash
# Builds .gpu_carry/ (git-ignored) beside the checkout: what bench/gpu_run.py needs on a GPU
# machine that has no network and whose image lacks it (bench/README.md):
#   .gpu_carry/wheels/         pure-Python wheels of span_lm's dependencies the image lacks
#   .gpu_carry/adaptive-span/  an export of facebookresearch/adaptive-span (the reference step;
#                              CC-BY-NC: carried to the machine, never committed)
#
#   bash bench/gpu_prepare.sh                               # reference from GitHub (network)
#   bash bench/gpu_prepare.sh --reference_dir ~/src/adaptive-span   # or from a checkout
#   bash bench/gpu_prepare.sh --reference_git /path/to/adaptive-span.git   # or a local clone
#
# The wheels are the dependencies a typical JAX GPU image (Python 3.12, jax/jaxlib with CUDA,
# flax, optax, orbax-checkpoint, absl-py, PyYAML, protobuf, numpy, torch, triton) lacks:
# ml_collections, tensorboardX and tqdm (the progress bar: optional, span_lm runs without it);
# WHEELS overrides the list (pins: the versions the CPU tests run with). Needs pip and network
# here, not on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=.gpu_carry
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-"ml_collections==1.1.0 tensorboardX==2.6.5 tqdm==4.70.1"}
REF_COMMIT=27b815f  # the reference commit span_lm's docs describe
REF_DIR=""
REF_GIT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --reference_dir) REF_DIR=$2; shift 2 ;;
    --reference_git) REF_GIT=$2; shift 2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/adaptive-span"

# 1. Wheels for CPython 3.12 on x86-64 Linux, dependencies named one by one (--no-deps): the
#    image has theirs, and a second version of a package stops an offline install.
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$OUT/wheels" $WHEELS

# 2. The reference's files (models.py, adaptive_span.py, adagrad_with_grad_clip.py, ...).
files() { # the Python files, LICENSE and the experiment scripts: no data, no images
  tar -x -C "$OUT/adaptive-span" --wildcards '*.py' LICENSE 'experiments/*'
}
if [[ -n "$REF_DIR" ]]; then
  [[ -f "$REF_DIR/models.py" ]] || { echo "$REF_DIR has no models.py" >&2; exit 2; }
  (cd "$REF_DIR" && tar -c --exclude='*/.git' ./*.py LICENSE experiments) | files
else
  if [[ -z "$REF_GIT" ]]; then
    REF_GIT="https://github.com/facebookresearch/adaptive-span"
  fi
  if [[ -d "$REF_GIT" ]] && git --git-dir "$REF_GIT" rev-parse -q --verify "$REF_COMMIT^{commit}" \
      >/dev/null 2>&1; then
    git --git-dir "$REF_GIT" archive "$REF_COMMIT" | files
  elif [[ -d "$REF_GIT/.git" ]]; then
    git -C "$REF_GIT" archive "$REF_COMMIT" | files
  else
    TMP=$(mktemp -d)
    git clone --quiet "$REF_GIT" "$TMP/ref"
    git -C "$TMP/ref" archive "$REF_COMMIT" | files
    rm -rf "$TMP"
  fi
fi
for f in models.py adaptive_span.py adagrad_with_grad_clip.py persistent_memory.py adaptive_io.py; do
  [[ -f "$OUT/adaptive-span/$f" ]] || { echo "the reference export lacks $f" >&2; exit 1; }
done
cat > "$OUT/README.txt" <<EOF
Built by bench/gpu_prepare.sh on $(date -u +%Y-%m-%dT%H:%MZ); git-ignored, never commit it.
wheels/: $(cd "$OUT/wheels" && ls | tr '\n' ' ')
adaptive-span/: facebookresearch/adaptive-span @$REF_COMMIT (CC-BY-NC 4.0, see its LICENSE).
EOF

# 3. Checks: size (the folder travels to the GPU machine with the checkout: keep it small) and
#    an offline install from the folder alone.
BYTES=$(du -sb "$OUT" | cut -f1)
if (( BYTES > 48 * 1024 * 1024 )); then
  echo "$OUT is $BYTES bytes: keep it under 48 MiB (it travels with the checkout)" >&2
  exit 1
fi
CHECK=$(mktemp -d)
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$CHECK" \
  "$OUT"/wheels/*.whl
PYTHONPATH="$CHECK" "$PY" -c "import ml_collections, tensorboardX" 2>/dev/null \
  || echo "note: the wheels installed offline but import here needs their dependencies" >&2
rm -rf "$CHECK"
echo "$OUT: $BYTES bytes; $(ls "$OUT/wheels" | wc -l) wheels; reference $(ls "$OUT/adaptive-span" | wc -l) entries"
echo "GPU command (bench/README.md): carry [\".gpu_carry\"], then"
echo "  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_carry/wheels/*.whl && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 python3 -m bench.gpu_run --out \$OUT"
