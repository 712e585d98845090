#!/usr/bin/env bash
# Run one experiment on every worker of a Cloud TPU pod slice (or of several slices).
#
#   scripts/launch_tpu_pod.sh --tpu NAME[,NAME...] --zone ZONE [--project PROJECT]
#       --config EXPERIMENT[:ARG] --workdir DIR [--repo URL [--ref REF]] [--dir REMOTE_DIR]
#       [--python PYTHON] [--no_install] [--dry_print] [-- EXTRA TRAIN FLAGS...]
#
# What it does, on every worker of every named TPU VM (gcloud ... --worker=all):
#   1. code: by default copies this checkout's files (tracked and untracked-but-not-ignored, as a
#      tarball: `gcloud compute tpus tpu-vm scp`) into REMOTE_DIR; with --repo, clones URL into
#      REMOTE_DIR (or fetches into an existing clone) and checks out REF (default: main);
#   2. install: `PYTHON -m pip install -e . 'jax[tpu]'` in REMOTE_DIR (skip with --no_install);
#   3. train: `BLOCKBENCH_MULTIPROCESS=1 PYTHON -m train --config EXPERIMENT --workdir DIR
#      EXTRA...`, all workers at once. BLOCKBENCH_MULTIPROCESS=1 makes the trainer call
#      jax.distributed.initialize(), which reads the worker list and this worker's id from the
#      TPU VM's metadata; each worker then loads only its rows of every batch.
#
# Arguments:
#   --tpu NAME[,NAME...]  TPU VM name(s). Several names (the slices of a multi-slice job, e.g.
#                         queued-resource nodes NAME-0,NAME-1) are launched in parallel; set
#                         the DCN factors too, e.g. `-- --config.mesh.dcn.data=2`.
#   --zone ZONE           e.g. us-central2-b.            --project PROJECT  optional.
#   --config EXPERIMENT   experiment file, relative to the repository root (PATH[:ARG]).
#   --workdir DIR         run directory: checkpoints, metrics, config. It must be one directory
#                         that every worker sees (NFS, or a bucket mounted with gcsfuse): Orbax
#                         writes each worker's shards there, and a rerun of the same command
#                         resumes from its newest checkpoint (e.g. after preemption).
#   --repo URL, --ref REF clone URL at REF instead of copying this checkout.
#   --dir REMOTE_DIR      where the code goes on each worker (default: ~/blockbench).
#   --python PYTHON       interpreter on the workers (default: python3).
#   --no_install          skip the pip install (code and dependencies already there).
#   --dry_print           print the commands (shell-quoted, copy-pastable) instead of running them.
#   -- EXTRA...           passed through to `python -m train`, e.g. --config.mesh.fsdp=8.
#
# Example (a v4-32 slice: 4 workers × 4 chips = 16 devices, FSDP over all of them):
#   scripts/launch_tpu_pod.sh --tpu my-v4-32 --zone us-central2-b \
#       --config experiments/quickstart.py --workdir /mnt/shared/runs/quickstart \
#       -- --config.mesh.data=1 --config.mesh.fsdp=16
# Check the sharding and per-device memory first, without the pod:
#   python scripts/dry_run.py --config experiments/quickstart.py --devices 16 --mesh data=1,fsdp=16
# The ssh sessions carry the run: keep this command's terminal open (e.g. inside tmux).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
fail() { echo "error: $*" >&2; exit 2; }

tpus="" zone="" project="" config="" workdir="" repo="" ref="main" remote_dir="~/blockbench"
python="python3" install=1 dry_print=0
extra=()
while (($#)); do
  case "$1" in
    --tpu) tpus="${2:?--tpu needs a value}"; shift 2 ;;
    --zone) zone="${2:?--zone needs a value}"; shift 2 ;;
    --project) project="${2:?--project needs a value}"; shift 2 ;;
    --config) config="${2:?--config needs a value}"; shift 2 ;;
    --workdir) workdir="${2:?--workdir needs a value}"; shift 2 ;;
    --repo) repo="${2:?--repo needs a value}"; shift 2 ;;
    --ref) ref="${2:?--ref needs a value}"; shift 2 ;;
    --dir) remote_dir="${2:?--dir needs a value}"; shift 2 ;;
    --python) python="${2:?--python needs a value}"; shift 2 ;;
    --no_install) install=0; shift ;;
    --dry_print) dry_print=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) fail "unknown argument $1 (see $0 --help)" ;;
  esac
done
[[ -n "$tpus" ]] || fail "--tpu is required, e.g. --tpu my-v4-32"
[[ -n "$zone" ]] || fail "--zone is required, e.g. --zone us-central2-b"
[[ -n "$config" ]] || fail "--config is required, e.g. --config experiments/quickstart.py"
[[ -n "$workdir" ]] || fail "--workdir is required: a directory every worker shares"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ -n "$repo" || -f "$repo_root/${config%%:*}" ]] \
  || fail "--config=${config%%:*} does not exist in $repo_root"

# A word for the remote shell: quoted, except a leading ~/ that the remote shell must expand.
remote_word() {
  if [[ "$1" == "~/"* ]]; then printf '~/%q' "${1#\~/}"; else printf '%q' "$1"; fi
}

show() {  # print a command on one line, single-quoting the words that need it
  local line="" word
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then line+="$word "
    else line+="'${word//\'/\'\\\'\'}' "; fi
  done
  echo "${line% }"
}

run() {  # run a command, or print it with --dry_print
  if ((dry_print)); then show "$@"; else "$@"; fi
}

gcloud_args=(--zone "$zone")
[[ -n "$project" ]] && gcloud_args+=(--project "$project")

dir="$(remote_word "$remote_dir")"
if [[ -n "$repo" ]]; then
  fetch="if [ -d $dir/.git ]; then git -C $dir fetch origin $(printf %q "$ref");"
  fetch+=" else git clone $(printf %q "$repo") $dir && git -C $dir fetch origin $(printf %q "$ref"); fi"
  code="$fetch && git -C $dir checkout --force FETCH_HEAD"
else
  tarball="/tmp/blockbench-code-$$.tgz"
  code="mkdir -p $dir && tar -xzf $tarball -C $dir && rm -f $tarball"
fi
install_step=""
((install)) && install_step="$python -m pip install -q -e . \"jax[tpu]\" && "
train_command="BLOCKBENCH_MULTIPROCESS=1 $python -m train --config $(printf %q "$config")"
train_command+=" --workdir $(remote_word "$workdir")"
for flag in "${extra[@]+"${extra[@]}"}"; do train_command+=" $(printf %q "$flag")"; done
remote="set -e; $code; cd $dir; $install_step$train_command"

if [[ -z "$repo" ]]; then
  archive=(bash -c "cd $(printf %q "$repo_root") && git ls-files -z --cached --others \
--exclude-standard | tar --null -T - -czf $tarball")
  run "${archive[@]}"
fi
IFS=',' read -r -a tpu_names <<< "$tpus"
pids=()
for tpu in "${tpu_names[@]}"; do
  [[ -z "$repo" ]] && run gcloud compute tpus tpu-vm scp "$tarball" "$tpu:$tarball" \
    "${gcloud_args[@]}" --worker=all
  if ((dry_print)); then
    run gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$remote"
  else
    gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$remote" &
    pids+=($!)
  fi
done
status=0
for pid in "${pids[@]+"${pids[@]}"}"; do wait "$pid" || status=$?; done
[[ -z "$repo" ]] && ((!dry_print)) && rm -f "$tarball"
exit "$status"
