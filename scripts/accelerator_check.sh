#!/usr/bin/env bash
# The accelerator check (issues 22 and 42): on a GPU or TPU host, under 10 minutes, one JSON
# line on stdout, and with --out DIR the same object in DIR/check.json (rewritten after each
# part, so a run cut short keeps what it finished) and the progress in DIR/check.log. The parts,
# most wanted first: attention implementations against the explicit path, Block AttnRes
# overhead against Pre-Norm, the AttnRes ablation's study mode against its 3-minute target,
# per-op profiles (--profile: DIR/profile.md and profile.json), the MFU of a ~1B bf16 model,
# memory at 8K context. On CPU the accelerator parts are skipped, each with its reason, and the
# study and profile parts run at tiny shapes. What each part measures:
# scripts/accelerator_check.py.
# Usage: scripts/accelerator_check.sh [--out DIR] [--profile] [--parts NAME,...] [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's packages
exec timeout 600 python scripts/accelerator_check.py "$@"
