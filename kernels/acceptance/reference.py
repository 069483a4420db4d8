"""The reference acceptance: dspark.sampling's samplers (they define the ops), registered as is."""
from dspark import sampling

from ..registry import register

register("rejection_sample", "reference", priority=0)(sampling.rejection_sample)
register("synthetic_sample", "reference", priority=0)(sampling.synthetic_sample)
