# Sourced by the rank rounds' scripts: CuTe DSL and apache-tvm-ffi (carried in .gpu), the package
# layout, the commit the tree was copied at (passed as the first argument).
R=$PWD
source .gpu/env.sh
pip install -q --no-deps --no-index --target /tmp/extra .gpu/wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/extra:$PYTHONPATH
source tools/lab/device_env.sh
export DSPARK_GIT_COMMIT=$1
