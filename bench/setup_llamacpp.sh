#!/usr/bin/env bash
# Build llama.cpp's command-line tools into bench/llamacpp/ (CPU only) for bench/llamacpp_compare.py.
#
#   bash bench/setup_llamacpp.sh                       # default version below
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bash bench/setup_llamacpp.sh
#   JOBS=4 bash bench/setup_llamacpp.sh                # more compile jobs (default 2)
#
# The source is the llama.cpp vendored in llama-cpp-python's sdist on PyPI (the only registry this
# machine reaches): `pip download --no-binary :all:` fetches it (~77 MB tarball), it is unpacked to
# bench/llamacpp/src/ and built with cmake into bench/llamacpp/build/ (Release, GGML_NATIVE, no curl,
# no OpenSSL, no server/tests/examples; shared libraries, so the sdist's ctypes bindings in
# bench/llamacpp/src/llama_cpp/ can load build/bin/libllama.so for the greedy-output check).
# Targets: llama-quantize, llama-batched-bench, llama-bench (and the libllama/libggml they link).
# Facts (llama-cpp-python 0.3.36 vendors llama.cpp commit 0c1e570 of 2026-10-01, which reports
# "version: 0.5.0-dev (build 1, commit 0c1e570)"; gcc 12.2, cmake 3.25, 2-core AMD EPYC with AVX-512 and
# avx512_bf16, no AMX): download ~6 s, configure + build 5.2 minutes wall (6.2 min CPU) at -j2 under
# nice 10 while other work ran; ggml's CPU backend is compiled with -march=native. ~14 MB of binaries.
# This llama.cpp has no curl code left (LLAMA_CURL is a deprecated option; OFF is passed all the same).
# Everything is gitignored (bench/llamacpp/). Skipped when the binaries exist (delete
# bench/llamacpp/build to rebuild). A log goes to bench/out/setup_llamacpp.log.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="$HERE/llamacpp"  # where bench/llamacpp_compare.py looks
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python3}"
BIN="$DEST/build/bin"
LOG="$HERE/out/setup_llamacpp.log"
TARGETS=(llama-quantize llama-batched-bench llama-bench)

mkdir -p "$HERE/out" "$DEST"
missing=0
for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || missing=1; done
[ -d "$DEST/src/current/llama_cpp" ] || missing=1  # the sources the compare script reads
if [ "$missing" = 0 ]; then
  echo "llama.cpp tools already built in $BIN (delete $DEST/build to rebuild)"
  exit 0
fi

exec > >(tee -a "$LOG") 2>&1
echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') setup_llamacpp.sh: llama-cpp-python==$VERSION"
start=$(date +%s)
SRC="$DEST/src/llama_cpp_python-$VERSION"
if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
  mkdir -p "$DEST/dl" "$DEST/src"
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST/dl"
  tar -xzf "$DEST/dl/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
fi
LLAMA="$SRC/vendor/llama.cpp"
echo "llama.cpp commit: $(git -C "$LLAMA" rev-parse --short HEAD 2>/dev/null || echo unknown)"

cmake -S "$LLAMA" -B "$DEST/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON
nice -n 10 cmake --build "$DEST/build" --config Release -j "$JOBS" --target "${TARGETS[@]}"
# bench/llamacpp_compare.py finds gguf-py and the ctypes bindings under src/current
ln -sfn "llama_cpp_python-$VERSION" "$DEST/src/current"

"$BIN/llama-batched-bench" --version 2>&1 | tail -2 || true
echo "llama.cpp tools ready in $BIN after $(( $(date +%s) - start )) s"
