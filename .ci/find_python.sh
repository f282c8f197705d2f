#!/usr/bin/env bash
# Print the path of a Python interpreter of version X.Y: `.ci/find_python.sh 3.9`.
#
# Looks for `pythonX.Y` on the PATH (a pyenv shim counts only if it runs), then in pyenv's
# versions folder (the newest X.Y.Z there). Exit 1, naming the version and where it looked,
# when there is none. Used by .ci/run and the Makefile's leg targets; `make test PYTHON=...`
# takes any interpreter directly.
set -uo pipefail
want="${1:?usage: find_python.sh X.Y}"
works() { "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '${want}'.split('.'))))" 2>/dev/null; }

if candidate="$(command -v "python${want}" 2>/dev/null)" && works "$candidate"; then
    echo "$candidate"
    exit 0
fi
root="${PYENV_ROOT:-}"
if [ -z "$root" ] && command -v pyenv >/dev/null 2>&1; then
    root="$(pyenv root 2>/dev/null)"
fi
root="${root:-$HOME/.pyenv}"
for dir in $(ls -d "$root/versions/${want}".* 2>/dev/null | sort -V -r); do
    candidate="$dir/bin/python${want}"
    if [ -x "$candidate" ] && works "$candidate"; then
        echo "$candidate"
        exit 0
    fi
done
echo "find_python.sh: no Python ${want}: python${want} is not on the PATH (or does not run)," \
     "and ${root}/versions has no ${want}.* install" >&2
exit 1
