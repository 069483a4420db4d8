# Source on a GPU machine that has torch but no network (the project's H200): make `import dspark`
# (with dspark.kernels -> kernels/ and dspark.drafters -> drafters/) work without pip, by laying
# the package out under /tmp/dspark_pkg with links to the source folders, and put it on PYTHONPATH.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rm -rf /tmp/dspark_pkg && mkdir -p /tmp/dspark_pkg
mkdir /tmp/dspark_pkg/dspark
for f in "$_root"/dspark/*; do ln -s "$f" /tmp/dspark_pkg/dspark/; done
ln -s "$_root/kernels" /tmp/dspark_pkg/dspark/kernels
ln -s "$_root/drafters" /tmp/dspark_pkg/dspark/drafters
export PYTHONPATH="/tmp/dspark_pkg:$_root/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
dspark() { python3 -m dspark.cli "$@"; }
