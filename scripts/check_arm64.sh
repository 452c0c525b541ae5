#!/usr/bin/env bash
# The arm64 kernels, bit for bit against this machine's: every weight format's matmul and one
# whole SmolLM2 forward, computed by an arm64 Python and by this machine's; then the arm64
# dot-product path's matmul speed against the generic path of the same arm64 Python.
#
#   scripts/check_arm64.sh                                  # on an arm64 machine
#   ARM64_PYTHON="CMD ARGS" scripts/check_arm64.sh           # elsewhere: a command that runs an
#                                                           # arm64 Python (e.g. under qemu)
# Env: ARM64_PYTHON (default python3 on arm64 hosts), HOST_PYTHON (default python3: a Python
# with this checkout installed), ARM64_CHECK_DIR (results and the arm64 kernel cache; default
# under ~/.cache/localllm). The arm64 Python needs numpy, numba, gguf, jinja2 and psutil; this
# checkout is put on its path. Kernel builds are cached there between runs: under emulation a
# cold build takes many minutes.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
HOST_PYTHON=${HOST_PYTHON:-python3}
DIR=${ARM64_CHECK_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/localllm/arm64-check}
case $(uname -m) in
  aarch64|arm64) ARM64_PYTHON=${ARM64_PYTHON:-python3}
                 REF_ENV=(NUMBA_CPU_FEATURES=+neon) ;;  # the reference: the generic path
  *) REF_ENV=()
     [[ -n ${ARM64_PYTHON:-} ]] || { echo "set ARM64_PYTHON to a command running an arm64 Python" >&2; exit 2; } ;;
esac
read -r -a ARM <<< "$ARM64_PYTHON"
mkdir -p "$DIR"

# The package as an editable install lays it out (localllm.kernels is kernels/, ...).
PKG=$DIR/pkg
rm -rf "$PKG" && mkdir -p "$PKG/localllm"
for f in "$REPO"/localllm/*; do ln -s "$f" "$PKG/localllm/"; done
for sub in backends kernels models; do ln -s "$REPO/$sub" "$PKG/localllm/$sub"; done
# arm [VAR=VALUE...] ARGS: arm64_results.py ARGS on the arm64 Python.
arm() {
  local envs=()
  while [[ $1 == *=* ]]; do envs+=("$1"); shift; done
  env PYTHONPATH="$PKG" NUMBA_CACHE_DIR="$DIR/numba" "${envs[@]}" "${ARM[@]}" \
    "$REPO/scripts/arm64_results.py" "$@"
}

MODEL=$("$HOST_PYTHON" -c "from localllm.formats.fetch import fetch; print(fetch('smollm2-135m', quiet=True))")
echo "== reference: $("$HOST_PYTHON" -c 'import platform; print(platform.machine())'), this checkout"
env "${REF_ENV[@]}" "$HOST_PYTHON" "$REPO/scripts/arm64_results.py" compute "$DIR/ref.npz" "$MODEL"
echo "== arm64: $("${ARM[@]}" -c 'import platform; print(platform.machine(), platform.python_version())')"
arm compute "$DIR/arm64.npz" "$MODEL"
status=0
"$HOST_PYTHON" "$REPO/scripts/arm64_results.py" compare "$DIR/arm64.npz" "$DIR/ref.npz" || status=$?

echo "== matmul speed on the arm64 Python: dot-product path vs generic path"
arm speed "$DIR/speed-dot.json"
arm NUMBA_CPU_FEATURES=+neon speed "$DIR/speed-generic.json"
"$HOST_PYTHON" - "$DIR/speed-dot.json" "$DIR/speed-generic.json" <<'EOF'
import json, sys
dot, gen = (json.load(open(p)) for p in sys.argv[1:3])
print(f"{'format':8} {dot['isa'] + ' ms':>12} {gen['isa'] + ' ms':>12} {'speed-up':>9}")
for k, t in dot["seconds"].items():
    g = gen["seconds"][k]
    print(f"{k:8} {t * 1e3:12.2f} {g * 1e3:12.2f} {g / t:8.1f}x")
EOF
exit $status
