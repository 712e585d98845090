#!/usr/bin/env bash
# The accelerator check (issue 22, item 6): on a GPU or TPU host, under 10 minutes, one JSON
# line on stdout: attention implementations against the explicit path, the MFU of a ~1B bf16
# model, Block AttnRes overhead against Pre-Norm, memory at 8K context. On CPU the accelerator
# parts are skipped, each with its reason in the JSON. What each part measures:
# scripts/accelerator_check.py. Usage: scripts/accelerator_check.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's packages
exec timeout 600 python scripts/accelerator_check.py "$@"
