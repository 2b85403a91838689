"""Worked examples of fused ops written by a user: a Triton kernel plus a chunk
schedule, made a fused op by overlap_kernels.FusedOp (docs/writing_fused_ops.md)."""
