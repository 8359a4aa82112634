#!/usr/bin/env bash
# Builds the engine and its tests three times (plain, ASan+UBSan, TSan) and
# runs each with ctest. Usage: native/tests/run_sanitizers.sh [build-dir]
# (default build/native-tests, relative to the repository root).
# Exits non-zero if any build or test fails; all three are tried regardless.
set -u

repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-build/native-tests}
case $out in
/*) ;;
*) out=$repo/$out ;;
esac
jobs=$(nproc 2>/dev/null || echo 2)

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1

# run NAME C_FLAGS: configure, build and test one flavour; returns non-zero on failure.
run() {
    local name=$1 flags=$2 dir=$out/$1
    echo "=== $name: $flags"
    # A cache generated from another checkout is refused by cmake; start that flavour afresh.
    if [ -f "$dir/CMakeCache.txt" ] &&
        ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$repo/native/tests" "$dir/CMakeCache.txt"; then
        rm -rf "$dir"
    fi
    cmake -S "$repo/native/tests" -B "$dir" -DCMAKE_BUILD_TYPE=None \
        -DCMAKE_C_FLAGS="$flags" >/dev/null || return 1
    cmake --build "$dir" -j "$jobs" || return 1
    rm -f "$dir"/tmp/streamer-engine-test-* # left by an earlier run that was killed
    ctest --test-dir "$dir" --output-on-failure
}

mkdir -p "$out"
failed=()
run plain "-O2 -g -Wall -Wextra -Werror" || failed+=(plain)
run asan "-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" ||
    failed+=(asan)
run tsan "-O1 -g -fsanitize=thread" || failed+=(tsan)

if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all engine test builds passed (plain, asan+ubsan, tsan)"
