#!/usr/bin/env bash
# The sandbox's two pure-Python kernel bindings (landlockpy, pyseccomp; pinned in pyproject.toml) as
# py3-none-any wheels in a git-ignored folder, to carry to a machine without network, e.g. the GPU device
# machine, whose staged bundle lacks them (rltrain/sandbox refuses tool calls without them):
#   make sandbox-wheels                  # -> .whl-sandbox/ (or: bash tools/sandbox_wheels.sh DIR)
# and there, before running anything that calls tools:
#   python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl-sandbox/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl-sandbox}
PY=${PY:-python3}
pins=$(grep -oE '"(landlockpy|pyseccomp)==[^;" ]+' pyproject.toml | tr -d '"')
if [ "$(printf '%s\n' "$pins" | grep -c .)" != 2 ]; then
  echo "sandbox_wheels: expected the landlockpy and pyseccomp pins in pyproject.toml, found: $pins" >&2
  exit 2
fi
mkdir -p "$DEST"
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$DEST" $pins
for w in "$DEST"/*.whl; do
  case "$w" in *-py3-none-any.whl) ;; *) echo "sandbox_wheels: $w is not pure Python" >&2; exit 1 ;; esac
done
ls -l "$DEST"
