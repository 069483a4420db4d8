# Source on the GPU machine inside a job: lays out the code a change started from, to time it beside the
# change in the same call. Copies the checkout (without .gpu) to /tmp/base and applies the round's patch
# from the change back to its base (`git diff HEAD BASE -- PATHS`, committed with the round), then lays
# /tmp/base out as the package under /tmp/base_pkg (device_env.sh) first on PYTHONPATH: `import dspark`
# is the base in this shell. Source it in a subshell, ( source ...; python3 /tmp/base/... ), so that the
# job's own shell keeps the checkout. Usage: source "$REPO/tools/lab/baseline_tree.sh" PATCH
_patch=$1
rm -rf /tmp/base && mkdir -p /tmp/base
tar -C "$REPO" --exclude=./.gpu --exclude="./.venv*" --exclude=./.git -cf - . | tar -C /tmp/base -xf -
if ! (cd /tmp/base && patch -p1 -s --no-backup-if-mismatch < "$_patch"); then
  echo "baseline_tree: $_patch does not apply to this checkout" >&2
  return 1
fi
DSPARK_PKG_DIR=/tmp/base_pkg source /tmp/base/tools/lab/device_env.sh
