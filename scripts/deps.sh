#!/usr/bin/env bash
# The project's pinned test dependencies (constraints.txt) and the check against the newest releases.
#
#   bash scripts/deps.sh newest    # a fresh venv with the NEWEST releases the test extra allows (no pins),
#                                  # shows what moved against constraints.txt, then runs the default suite
#   bash scripts/deps.sh refresh   # the same fresh install, written to constraints.txt (review the diff,
#                                  # run the suite on it, commit it)
#
# Library users who `pip install mnemojax` get pyproject.toml's loose lower bounds; the project's tests and CI
# install with `-c constraints.txt` so they cannot drift. `newest` is how drift is seen before users see it.
# VENV=<dir> chooses where the throw-away environment goes (default: a new temporary directory); PYTHON=<interpreter>
# which Python builds it (default python3); EXTRA="<requirements>" what to install on top, e.g. the GPU image's jax,
# which needs Python >= 3.12 (the pins are for 3.11, where pip sees no jax past 0.10):
#   PYTHON=python3.13 EXTRA="jax==0.11.2 jaxlib==0.11.2" bash scripts/deps.sh newest
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in newest|refresh) ;; *) echo "usage: bash scripts/deps.sh newest|refresh" >&2; exit 2 ;; esac

venv="${VENV:-$(mktemp -d)/venv}"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install -q --upgrade -e ".[test]" ${EXTRA:-}
frozen="$(mktemp)"
{
    echo "# Pinned test dependencies for CPython $("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"\
         "on $(uname -m) Linux: pip constraints, used by the README's test command and .ci/run."
    echo "# Made by 'bash scripts/deps.sh refresh' on $(date -u +%Y-%m-%d); do not edit by hand."
    "$venv/bin/python" -m pip freeze --all --exclude-editable | LC_ALL=C sort -f
} > "$frozen"

if [ "$mode" = refresh ]; then
    mv "$frozen" constraints.txt
    echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins); now run the suite on it and commit"
    exit 0
fi
echo "== newest releases against constraints.txt (< pinned, > newest):"
diff <(grep -v '^#' constraints.txt) <(grep -v '^#' "$frozen") || true
echo "== the default suite on the newest releases ($venv: $("$venv/bin/python" --version); jax $("$venv/bin/python" -c 'import jax; print(jax.__version__)'))"
"$venv/bin/python" -m pytest -q -n 2
