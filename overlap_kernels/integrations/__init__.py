"""Integrations: the ops as PyTorch custom ops with autograd, and functions for
tensor-parallel linear layers. Imports go one way: integrations use ops, ops
never import integrations.

Every module here imports ``overlap_kernels`` first: ``torch._inductor``
imports triton, and on a machine without a GPU triton must be imported after
overlap_kernels has turned its interpreter on (runtime/platform.py).
"""
