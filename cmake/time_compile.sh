#!/usr/bin/env bash
# Compiler launcher (cmake/SqueezeDependencies.cmake): runs the rest of its arguments (ccache, the compiler, its
# flags) and appends "<seconds> <source>" to the log named first, so the build can print its slowest units.
log=$1; shift
start=$(date +%s%N)
"$@"
rc=$?
src=""
prev=""
for a in "$@"; do [ "$prev" = "-c" ] && src=$a; prev=$a; done
printf '%.1f %s\n' "$(( $(date +%s%N) - start ))e-9" "$src" >> "$log"
exit $rc
