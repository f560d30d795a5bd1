#!/usr/bin/env bash
# Set up everything on a fresh machine (venv, pinned deps, native build), then run a job.
#   bash scripts/dev.sh demo [args]   the main job: hi-na-moe demo
#   bash scripts/dev.sh test [args]   the whole test suite (C++ kernel tests + pytest)
#   bash scripts/dev.sh setup         only the set-up
#   bash scripts/dev.sh test-aarch64  the C++ kernel tests cross-compiled for aarch64, run under
#                                     qemu-user for CPU models without dotprod, with it, with i8mm
#                                     and bf16
#                                     (needs g++-aarch64-linux-gnu and qemu-user)
#   bash scripts/dev.sh sanitize      the C++ runners under ASan+UBSan and under TSan (full sets)
#   bash scripts/dev.sh fuzz          the packed-header fuzz target: gcc driver under ASan+UBSan,
#                                     then libFuzzer (clang; installed with apt-get when missing)
#   bash scripts/dev.sh test-asan-python [pytest args]
#                                     pytest against an ASan+UBSan build of the extension
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
  # tests/test_serve_page.py drives the chat page in the system's Chromium (it skips, naming the fix, without it)
  if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Chromium with apt-get (for tests/test_serve_page.py)"
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; } ||
      echo "[setup] warning: apt-get could not install chromium: tests/test_serve_page.py will skip" >&2
  fi
  echo "[setup] building the native core (scikit-build-core + CMake + nanobind)"
  python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
  python -c "import hi_na_moe, sys; from hi_na_moe.core.native import native_module; m, why = native_module(); sys.exit(0 if m else f'native core failed to load: {why}')"
}

jobs="${HINA_JOBS:-2}"  # build jobs (2-core machines share them with whoever else runs)

# ---- sanitizer builds of the C++ core (CMake HINA_SANITIZE) ----
# Reports fail the run: UBSan and TSan halt on the first one, ASan always does.
san_env() {
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
  export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"
}
# Whether the compiler can link -fsanitize=$1 (the runtime libraries are installed).
san_available() {
  echo 'int main() { return 0; }' | ${CXX:-c++} -x c++ -fsanitize="$1" - -o /dev/null >/dev/null 2>&1
}
san_build() {  # build dir, -fsanitize list, targets...
  local dir="$1" list="$2" t0=$SECONDS
  shift 2
  cmake -S . -B "$dir" -G Ninja -DHINA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release -DHINA_SANITIZE="$list" >/dev/null
  cmake --build "$dir" -j "$jobs" --target "$@" >/dev/null
  echo "[sanitize] built $(basename "$dir") ($*): $((SECONDS - t0)) s"
}
# hina_tests output without the per-kernel 'worst' / SQNR lines (FAIL lines and the closing
# "N passed, N failed" stay)
quiet_kernels() { grep -v -e '^worst ' -e '^lowest SQNR' || true; }

# The sanitizer runs. ci: the reduced set `test` runs (about 2-3 minutes on 2 cores): hina_tests
# on one in 3 of its per-case runs and the pool tests under ASan+UBSan, a short fuzz-driver run,
# the pool tests and the memory tier's tests (threads: its I/O workers and concurrent forwards)
# under TSan. full: every case under both, the fuzz driver longer.
run_sanitizers() {
  local mode="$1" t0=$SECONDS every=1 iters=20000 asan="$root/build/san-asan" tsan="$root/build/san-tsan"
  if [ "$mode" = ci ]; then every=3; iters=3000; fi
  san_env
  if san_available address,undefined; then
    local which="every case"
    [ "$every" -gt 1 ] && which="--every $every"
    echo "[sanitize] ASan+UBSan: hina_tests ($which), hina_pool_tests, fuzz driver ($iters inputs)"
    san_build "$asan" address,undefined hina_tests hina_pool_tests hina_fuzz_header
    "$asan/hina_tests" --every "$every" | quiet_kernels
    if [ -x "$asan/hina_pool_tests" ]; then "$asan/hina_pool_tests"; fi
    (cd "$root/build" && "$asan/hina_fuzz_header" --iters "$iters")
  else
    echo "(compiler cannot link -fsanitize=address,undefined: ASan/UBSan runs skipped)"
  fi
  if san_available thread; then
    local targets=(hina_pool_tests hina_tests)
    echo "[sanitize] TSan: ${targets[*]}$([ "$mode" = full ] || echo ' (hina_tests: the memory tier)')"
    san_build "$tsan" thread "${targets[@]}"
    if [ -x "$tsan/hina_pool_tests" ]; then "$tsan/hina_pool_tests"; else echo "(compiler without OpenMP: pool tests not built)"; fi
    if [ "$mode" = full ]; then "$tsan/hina_tests" | quiet_kernels; else "$tsan/hina_tests" tier | quiet_kernels; fi
  else
    echo "(compiler cannot link -fsanitize=thread: TSan runs skipped)"
  fi
  echo "[sanitize] $mode set: $((SECONDS - t0)) s"
}

# The packed-header fuzz target (csrc/tests/fuzz_packed_header.cpp): the deterministic gcc driver
# under ASan+UBSan, then libFuzzer for HINA_FUZZ_SECONDS (default 120). libFuzzer needs clang:
# installed with apt-get when missing and this is root on a Debian-like system.
run_fuzz() {
  local asan="$root/build/san-asan" lf="$root/build/fuzz-clang" out="$root/build/fuzz"
  local secs="${HINA_FUZZ_SECONDS:-120}"
  san_env
  echo "[fuzz] gcc driver under ASan+UBSan: ${HINA_FUZZ_ITERS:-200000} mutated inputs"
  san_build "$asan" address,undefined hina_fuzz_header
  mkdir -p "$out"
  (cd "$out" && "$asan/hina_fuzz_header" --iters "${HINA_FUZZ_ITERS:-200000}" --seed "${HINA_FUZZ_SEED:-1}")
  if ! command -v clang++ >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "[fuzz] clang++ not found: installing clang with apt-get"
      DEBIAN_FRONTEND=noninteractive apt-get install -y clang >/dev/null 2>&1 ||
        { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y clang >/dev/null; }
    else
      echo "clang++ not found: libFuzzer needs clang (Debian: apt-get install clang); only the gcc driver ran" >&2
      exit 2
    fi
  fi
  echo "[fuzz] libFuzzer (clang, ASan+UBSan) for $secs s; corpus build/fuzz/corpus, crashes build/fuzz/crash-*"
  CXX=clang++ cmake -S . -B "$lf" -G Ninja -DHINA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
    -DHINA_SANITIZE=address,undefined -DHINA_LIBFUZZER=ON >/dev/null
  cmake --build "$lf" -j "$jobs" --target hina_fuzz_header_libfuzzer >/dev/null
  rm -rf "$out/seeds"
  mkdir -p "$out/seeds" "$out/corpus"
  "$asan/hina_fuzz_header" --write-seeds "$out/seeds" >/dev/null
  local rc=0
  "$lf/hina_fuzz_header_libfuzzer" -max_total_time="$secs" -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$out/" "$out/corpus" "$out/seeds" >"$out/libfuzzer.log" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    tail -n 60 "$out/libfuzzer.log"
    echo "libFuzzer failed (exit $rc); full log build/fuzz/libfuzzer.log, replay: build/san-asan/hina_fuzz_header build/fuzz/crash-*" >&2
    exit $rc
  fi
  grep -E '^#[0-9]+[[:space:]]+DONE|^stat::' "$out/libfuzzer.log"
  local execs
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out/libfuzzer.log")
  echo "libFuzzer: $execs inputs in $secs s, no crash"
  echo "$execs passed, 0 failed"
}

# pytest against an ASan+UBSan build of the extension, in a second venv (build/venv-asan) that
# sees the main venv's packages through a .pth file, so nothing is installed twice and the
# main venv's build is untouched. libasan must be the first library loaded (LD_PRELOAD) and
# libstdc++ with it, or ASan cannot intercept C++ throws from the extension; leak checking is
# off because CPython and torch keep allocations until exit by design.
run_asan_python() {
  local av="$root/build/venv-asan"
  if [ ! -x "$av/bin/python" ]; then "$py" -m venv "$av"; fi
  local main_site asan_site
  main_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  asan_site="$("$av/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$main_site" > "$asan_site/hina-main-venv.pth"
  echo "[asan-python] building the extension with HINA_SANITIZE=address,undefined (build/asan-ext)"
  "$av/bin/python" -m pip install -q --no-deps --no-build-isolation -e . \
    -Ccmake.define.HINA_SANITIZE=address,undefined -Cbuild-dir=build/asan-ext 2>&1 |
    grep -v -e "^WARNING: Location" -e "outside environment" -e "No files were found to uninstall" || true
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0}"
  san_env
  echo "[asan-python] pytest ${*:-tests}"
  set +e
  LD_PRELOAD="$(${CXX:-c++} -print-file-name=libasan.so) $(${CXX:-c++} -print-file-name=libstdc++.so)" \
    "$av/bin/python" -m pytest -p no:cacheprovider "${@:-tests}"
  local rc=$?
  set -e
  exit $rc
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
    # the reduced sanitizer set (HINA_SKIP_SANITIZE=1 skips it; `sanitize` runs the full one)
    if [ "${HINA_SKIP_SANITIZE:-0}" != 1 ]; then run_sanitizers ci; fi
  fi
  if [ -n "${ATEN_CPU_CAPABILITY:-}" ]; then
    local torch_cap
    torch_cap="$(torch_capability "$ATEN_CPU_CAPABILITY")"  # (not inside echo: its failure must exit)
    echo "[test] pytest (ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY: PyTorch's $torch_cap build)"
  else
    echo "[test] pytest"
  fi
  run_pytest "$@"
  # the same suite with the kernel tier forced to each lower tier this CPU has (HINA_MOE_ISA), so
  # the model-level paths of AVX2-only and generic CPUs are tested too (HINA_TEST_LOWER_TIERS=0
  # skips these; a HINA_MOE_ISA already set runs that tier alone). PyTorch is held to the build
  # such a CPU would run (ATEN_CPU_CAPABILITY): its AVX2 and baseline kernels round differently
  # from its AVX-512 ones, and tests that compare with its arithmetic must hold there too. An
  # ATEN_CPU_CAPABILITY the caller set is kept. On aarch64 the tiers are the Arm ones, and every
  # CPU whose best tier is a lower one runs PyTorch's default build (its aarch64 builds take only
  # default and sve256, and 256-bit SVE CPUs have every Arm tier).
  if [ "${HINA_TEST_LOWER_TIERS:-1}" != 0 ] && [ -z "${HINA_MOE_ISA:-}" ]; then
    local tiers cap torch_cap arm=0 order='("generic", "avx2", "avx512", "amx")'
    case "$(uname -m)" in aarch64 | arm64) arm=1; order='("generic", "neon", "dotprod", "i8mm", "bf16")' ;; esac
    tiers="$(python -c "from hi_na_moe import _native as n; best = n.resolve_isa(); order = $order; print(' '.join(t for t in order[:order.index(best)] if n.isa_supported(t)))")"
    for tier in $tiers; do
      if [ -n "${ATEN_CPU_CAPABILITY:-}" ]; then
        cap="$ATEN_CPU_CAPABILITY"
      elif [ $arm = 1 ]; then
        cap=default
      else
        case "$tier" in generic) cap=default ;; *) cap="$tier" ;; esac
      fi
      torch_cap="$(torch_capability "$cap")"
      echo "[test] pytest with the kernel tier forced to $tier (HINA_MOE_ISA=$tier, ATEN_CPU_CAPABILITY=$cap: PyTorch's $torch_cap build)"
      # (the Ray cluster test once, above: it checks Serve's orchestration, not kernels, and takes 1.5 min)
      HINA_MOE_ISA="$tier" ATEN_CPU_CAPABILITY="$cap" run_pytest -m "not ray_cluster" "$@"
    done
  fi
}

# The build PyTorch runs under ATEN_CPU_CAPABILITY=$1 (torch.backends.cpu.get_cpu_capability());
# exits when that is not the build $1 names (torch ignores a value it does not take, with a warning)
torch_capability() {
  local got
  got="$(ATEN_CPU_CAPABILITY="$1" python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())' 2>/dev/null)" || true
  if [ "$got" != "$(echo "$1" | tr a-z A-Z)" ]; then
    echo "ATEN_CPU_CAPABILITY=$1 did not take effect: torch.backends.cpu.get_cpu_capability() gave '$got', so" \
      "pytest would test another PyTorch build than the one meant (the values torch takes: default, avx2," \
      "avx512, in lower case, up to what the CPU has; on aarch64 default, and sve256 on CPUs with 256-bit SVE)" >&2
    exit 1
  fi
  echo "$got"
}

# pytest; exit 5 (no tests collected) is a failure, not a pass
run_pytest() {
  set +e
  python -m pytest "$@"
  local rc=$?
  set -e
  if [ $rc -eq 5 ]; then
    echo "pytest collected no tests: that is a failure, not a pass" >&2
    exit 1
  fi
  if [ $rc -ne 0 ]; then exit $rc; fi
}

# The C++ core cross-compiled for aarch64 and its test runner run under qemu-user, so the Arm
# build and its tiers are checked from an x86 machine: once per qemu CPU model in
# HINA_AARCH64_CPUS, by default one with the dot-product extension (neoverse-n1: tiers neon and
# dotprod, i8mm and bf16 refused), one without (cortex-a57: tier neon, dotprod refused) and one
# with i8mm and bf16 (neoverse-v1, or max where qemu has no neoverse-v1 model, as Debian 12's
# qemu 7.2: every Arm tier), so dispatch and every tier's kernels run. Not part of `test`: on
# the 2-core machine of 2026-12-07 each model's run took several minutes under qemu.
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
  # (the toolchain file only on the first configure: CMake warns that a configured tree ignores it)
  local tcarg=()
  [ -f "$build/CMakeCache.txt" ] || tcarg=(-DCMAKE_TOOLCHAIN_FILE="$tc")
  cmake -S . -B "$build" -G Ninja -DHINA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release "${tcarg[@]}" >/dev/null
  cmake --build "$build" -j "$jobs" --target hina_tests >/dev/null
  local cpu t0 v1=neoverse-v1
  qemu-aarch64 -cpu help | grep -qw neoverse-v1 || v1=max
  for cpu in ${HINA_AARCH64_CPUS:-neoverse-n1 cortex-a57 $v1}; do
    t0=$SECONDS
    echo "[test-aarch64] hina_tests under qemu-aarch64 -cpu $cpu"
    qemu-aarch64 -cpu "$cpu" -L /usr/aarch64-linux-gnu "$build/hina_tests" "$@" | quiet_kernels
    echo "[test-aarch64] -cpu $cpu: $((SECONDS - t0)) s"
  done
}

cmd="${1:-}"
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec hi-na-moe demo "$@" ;;
  test) setup; run_tests "$@" ;;
  test-aarch64) run_aarch64_tests "$@" ;;
  sanitize) run_sanitizers full ;;
  fuzz) run_fuzz ;;
  test-asan-python) setup; run_asan_python "$@" ;;
  *) echo "usage: bash scripts/dev.sh {demo|test|setup|test-aarch64|sanitize|fuzz|test-asan-python} [args]" >&2; exit 2 ;;
esac
