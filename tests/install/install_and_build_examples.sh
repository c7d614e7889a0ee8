#!/usr/bin/env bash
# Installs this build into a temporary prefix, then uses it as an outside project would: examples/
# built with find_package(kiln 0.1) and kiln::kiln (libkiln.so), a program built with pkg-config
# against libkiln.so and against libkiln.a, and the installed `kiln` command on the embedded model it
# finds beside itself. Nothing of kiln is recompiled.
# Usage: install_and_build_examples.sh BUILD_DIR SOURCE_DIR CMAKE CXX GENERATOR
set -euo pipefail
build=$1 source=$2 cmake=$3 cxx=$4 generator=$5
prefix=$(mktemp -d "${TMPDIR:-/tmp}/kiln-install.XXXXXX")
trap 'rm -rf "$prefix"' EXIT
fail() { echo "install test: $*" >&2; exit 1; }

"$cmake" --install "$build" --prefix "$prefix/usr" >/dev/null
p=$prefix/usr
libdir=$(dirname "$(find "$p" -name libkiln.so -print -quit)")
[ -f "$p/include/kiln/kiln.h" ] || fail "no include/kiln/kiln.h"
grep -q '#define KILN_VERSION_MAJOR' "$p/include/kiln/version.h" || fail "no KILN_VERSION_MAJOR in kiln/version.h"
[ -f "$libdir/libkiln.a" ] || fail "no libkiln.a beside libkiln.so in $libdir"
soname=$(readelf -d "$libdir/libkiln.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libkiln.so.0.1" ] || fail "libkiln.so's SONAME is '$soname', expected libkiln.so.0.1"
[ -e "$libdir/$soname" ] || fail "$soname is not installed"
[ -f "$p/share/kiln/models/kiln-tiny/config.json" ] || fail "the embedded model is not in share/kiln/models"

# examples/ as an outside CMake project (its own build type: -O0 builds fastest).
"$cmake" -S "$source/examples" -B "$prefix/examples" -G "$generator" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_PREFIX_PATH="$p" -DCMAKE_BUILD_TYPE=Debug >"$prefix/examples.log" 2>&1 \
  || { cat "$prefix/examples.log" >&2; fail "configuring examples/ against the prefix failed"; }
"$cmake" --build "$prefix/examples" >>"$prefix/examples.log" 2>&1 \
  || { cat "$prefix/examples.log" >&2; fail "building examples/ against the prefix failed"; }
out=$("$prefix/examples/example_mlp") || fail "example_mlp failed: $out"
grep -qF "max |kiln - reference|" <<<"$out" || fail "example_mlp printed no check: $out"
readelf -d "$prefix/examples/example_mlp" | grep -q "libkiln.so.0.1" || fail "example_mlp does not link libkiln.so"
[ -f "$prefix/examples/custom_op/libkiln_custom_op_example.so" ] || fail "the custom-op example did not build"

# A version check too old for the package is refused (0.x: the same minor version only).
mkdir -p "$prefix/old"
printf 'cmake_minimum_required(VERSION 3.25)\nproject(old CXX)\nfind_package(kiln 0.0 REQUIRED)\n' > "$prefix/old/CMakeLists.txt"
if "$cmake" -S "$prefix/old" -B "$prefix/old/build" -DCMAKE_PREFIX_PATH="$p" >/dev/null 2>&1; then
  fail "find_package(kiln 0.0) accepted version $(sed -n 's/.*KILN_VERSION_STRING "\(.*\)"/\1/p' "$p/include/kiln/version.h")"
fi

# pkg-config: a program that checks the headers' version against the library's.
cat > "$prefix/version.cpp" <<'CPP'
#include <kiln/kiln.h>
#include <cstdio>
#include <cstring>
int main() {
  std::printf("%s\n", kiln::version());
  return std::strcmp(kiln::version(), KILN_VERSION_STRING) == 0 ? 0 : 1;
}
CPP
export PKG_CONFIG_PATH="$libdir/pkgconfig"
version=$(pkg-config --modversion kiln) || fail "pkg-config does not find kiln.pc"
# shellcheck disable=SC2046
"$cxx" -std=c++20 "$prefix/version.cpp" -o "$prefix/version_shared" $(pkg-config --cflags --libs kiln) \
  -Wl,-rpath,"$libdir" || fail "linking against libkiln.so through pkg-config failed"
[ "$("$prefix/version_shared")" = "$version" ] || fail "libkiln.so reports another version than kiln.pc's $version"
# shellcheck disable=SC2046
"$cxx" -std=c++20 "$prefix/version.cpp" -o "$prefix/version_static" -Wl,-Bstatic -lkiln -Wl,-Bdynamic \
  $(pkg-config --cflags --libs --static kiln | sed 's/-lkiln//') || fail "linking libkiln.a through pkg-config --static failed"
readelf -d "$prefix/version_static" | grep -q libkiln && fail "version_static links libkiln.so, not libkiln.a"
[ "$("$prefix/version_static")" = "$version" ] || fail "libkiln.a reports another version than $version"
# kiln::kiln_static: libkiln.a with its dependencies found by kilnConfig.cmake.
mkdir -p "$prefix/static"
cp "$prefix/version.cpp" "$prefix/static/"
printf 'cmake_minimum_required(VERSION 3.25)\nproject(static CXX)\nfind_package(kiln 0.1 REQUIRED)\nadd_executable(version version.cpp)\ntarget_link_libraries(version PRIVATE kiln::kiln_static)\n' \
  > "$prefix/static/CMakeLists.txt"
{ "$cmake" -S "$prefix/static" -B "$prefix/static/build" -G "$generator" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$p" \
  && "$cmake" --build "$prefix/static/build"; } >"$prefix/static.log" 2>&1 \
  || { cat "$prefix/static.log" >&2; fail "building against kiln::kiln_static failed"; }
[ "$("$prefix/static/build/version")" = "$version" ] || fail "kiln::kiln_static's program reports another version"

# The installed command: its version, and the embedded model found beside it (not in the source tree).
[ "$("$p/bin/kiln" --version)" = "kiln $version" ] || fail "kiln --version is not 'kiln $version'"
gen=$(cd / && "$p/bin/kiln" generate -p "Once upon a time" -n 4 --temp 0 -t 1 2>"$prefix/generate.err") \
  || { cat "$prefix/generate.err" >&2; fail "the installed kiln generate failed"; }
[ -n "$gen" ] || fail "the installed kiln generated nothing"
grep -q "generated: 4 tokens" "$prefix/generate.err" || fail "unexpected stats: $(cat "$prefix/generate.err")"
echo "install test: $p: headers, libkiln.so ($soname), libkiln.a, kilnConfig.cmake, kiln.pc, kiln $version and its model"
