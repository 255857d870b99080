#!/usr/bin/env bash
# One leg of the device matrix: ci/test.sh cpu|cuda|npu [extra pytest arguments]
#
#   cpu   everything not marked cuda or npu (multiproc gloo tests included); device tests
#         are deselected, so the hosted runner never needs a device.
#   cuda  the full suite with PORTAPIPE_REQUIRE_DEVICES=cuda: tests marked cuda run and a
#         missing or unusable GPU fails them instead of skipping (npu tests skip, saying so).
#   npu   the same with PORTAPIPE_REQUIRE_DEVICES=npu, after installing the npu extra
#         (torch_npu) and loading Huawei CANN's environment.
#
# The virtual environment is built by `make install` (.venv, editable install with the test
# extra), as `make test` does.
set -euo pipefail

device="${1:-}"
case "$device" in
  cpu|cuda|npu) shift ;;
  *) echo "usage: ci/test.sh cpu|cuda|npu [pytest arguments]" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."
if [ "$device" = cpu ]; then
  make install
else
  make install TORCH_CPU=  # a device leg needs torch's device build, not the CPU-only one
fi
py=.venv/bin/python

if [ "$device" = npu ]; then
  # CANN's set_env.sh reads unset variables; relax -u while sourcing it.
  cann="${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit}/set_env.sh"
  if [ -f "$cann" ]; then
    set +u
    # shellcheck disable=SC1090
    source "$cann"
    set -u
  else
    echo "ci/test.sh npu: $cann not found; the npu tests will fail unless CANN's environment is already set" >&2
  fi
  "$py" -m pip install -q -e ".[test,npu]"
fi

# What this machine offers, for the log: torch version, devices, what `auto` picks.
.venv/bin/portapipe info

case "$device" in
  cpu)  exec "$py" -m pytest -q -m "not cuda and not npu" "$@" ;;
  cuda) PORTAPIPE_REQUIRE_DEVICES=cuda exec "$py" -m pytest -q "$@" ;;
  npu)  PORTAPIPE_REQUIRE_DEVICES=npu exec "$py" -m pytest -q "$@" ;;
esac
