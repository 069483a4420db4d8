# Source on a GPU machine that has torch but no network (the project's H200): make `import dspark`
# (with dspark.kernels -> kernels/ and dspark.drafters -> drafters/) work without pip, by laying
# the package out under /tmp/dspark_pkg (or $DSPARK_PKG_DIR) with links to the source folders, and put
# it on PYTHONPATH.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
_pkg=${DSPARK_PKG_DIR:-/tmp/dspark_pkg}
rm -rf "$_pkg" && mkdir -p "$_pkg/dspark"
for f in "$_root"/dspark/*; do ln -s "$f" "$_pkg/dspark/"; done
ln -s "$_root/kernels" "$_pkg/dspark/kernels"
ln -s "$_root/drafters" "$_pkg/dspark/drafters"
export PYTHONPATH="$_pkg:$_root/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
dspark() { python3 -m dspark.cli "$@"; }
