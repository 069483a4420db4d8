"""dspark.kernels, the ground floor: the ops the models call (ops.py), their registry and their
implementations (a plain-torch reference per op, faster GPU builds beside it), and the numerics
the references share (numerics.py, mxfp4.py). Nothing here imports the rest of dspark
(tests/test_layering.py checks it)."""
