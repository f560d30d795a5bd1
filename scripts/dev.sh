#!/usr/bin/env bash
# Set up everything on a fresh machine (venv, pinned deps, native build), then run a job.
#   bash scripts/dev.sh demo [args]   the main job: hi-na-moe demo
#   bash scripts/dev.sh test [args]   the whole test suite (C++ kernel tests + pytest)
#   bash scripts/dev.sh setup         only the set-up
#   bash scripts/dev.sh test-aarch64  the C++ kernel tests cross-compiled for aarch64, run under
#                                     qemu (needs g++-aarch64-linux-gnu and qemu-user)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${HINA_VENV:-$root/.venv}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

setup() {
  if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv"
    "$py" -m venv "$venv"
  fi
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
  local stamp="$venv/.hina-deps-$(sha1sum requirements-dev.txt | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    echo "[setup] installing pinned dependencies (requirements-dev.txt)"
    python -m pip install -q -r requirements-dev.txt
    touch "$stamp"
  fi
  echo "[setup] building the native core (scikit-build-core + CMake + nanobind)"
  python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
  python -c "import hi_na_moe, sys; from hi_na_moe.hardware import native_module; m, why = native_module(); sys.exit(0 if m else f'native core failed to load: {why}')"
}

run_tests() {
  local build="$root/build/cpp-tests"
  if [ -f csrc/tests/CMakeLists.txt ] || grep -q HINA_BUILD_TESTS CMakeLists.txt; then
    echo "[test] C++ kernel tests"
    cmake -S . -B "$build" -G Ninja -DHINA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$build" >/dev/null
    "$build/hina_tests"
    # the thread pool's OpenMP backend (built when the compiler has OpenMP)
    if [ -x "$build/hina_pool_tests" ]; then "$build/hina_pool_tests"; else echo "(compiler without OpenMP: thread-pool backend tests not built)"; fi
  fi
  echo "[test] pytest"
  set +e
  python -m pytest "$@"
  local rc=$?
  set -e
  if [ $rc -eq 5 ]; then
    echo "pytest collected no tests: that is a failure, not a pass" >&2
    exit 1
  fi
  exit $rc
}

# The C++ core cross-compiled for aarch64 (generic kernels: no NEON tier yet) and its test runner
# run under qemu-user, so the ARM build is checked from an x86 machine.
run_aarch64_tests() {
  for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "$tool not found: install the cross toolchain and qemu (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)" >&2
      exit 2
    fi
  done
  local build="$root/build/aarch64" tc="$root/build/aarch64-toolchain.cmake"
  mkdir -p "$root/build"
  cat > "$tc" <<'TC'
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
TC
  cmake -S . -B "$build" -G Ninja -DHINA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_TOOLCHAIN_FILE="$tc" >/dev/null
  cmake --build "$build" --target hina_tests >/dev/null
  qemu-aarch64 -L /usr/aarch64-linux-gnu "$build/hina_tests" "$@"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec hi-na-moe demo "$@" ;;
  test) setup; run_tests "$@" ;;
  test-aarch64) run_aarch64_tests "$@" ;;
  *) echo "usage: bash scripts/dev.sh {demo|test|setup|test-aarch64} [args]" >&2; exit 2 ;;
esac
