"""moe_dispatch_gemm's "auto" path: chosen from the exchanged counts, alike on every rank.

Ranks route different numbers of tokens (5, 9, 7); ``fused_max_tokens`` at the
largest of them sends every rank down the fused path, one below it down
``auto_path``. Deciding from a rank's own T would split the ranks between two
protocols (and hang); the result is checked against fp32 on each path.
"""

from __future__ import annotations

import pytest
import torch

from overlap_kernels.launch import run_ranks

TOKENS = (5, 9, 7)


def paths_body(rank: int, world: int) -> list[str]:
    import overlap_kernels as ok

    torch.manual_seed(17 + rank)
    t, h, n, num_experts = TOKENS[rank], 32, 24, 2 * world
    x = torch.randn(t, h)
    topk_ids = torch.stack([torch.randperm(num_experts)[:2] for _ in range(t)])
    topk_weights = torch.rand(t, 2)
    w1 = torch.randn(2, h, n)
    taken = []
    for limit in (max(TOKENS[:world]), max(TOKENS[:world]) - 1):
        config = {"path": "auto", "auto_path": "unfused", "fused_max_tokens": limit}
        out, handle = ok.moe_dispatch_gemm(x, topk_ids, topk_weights, w1, num_experts=num_experts, config=config)
        recv_x, _ = ok.moe_dispatch(x, topk_ids, topk_weights, num_experts=num_experts)
        experts = torch.repeat_interleave(torch.arange(2), torch.tensor(handle.expert_counts))
        reference = torch.stack([recv_x[i] @ w1[e] for i, e in enumerate(experts.tolist())]) if len(experts) else out
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)  # fp32: summation order only
        taken.append(handle.path)
    return taken


@pytest.mark.parametrize("world", [2, 3])
def test_auto_path_is_decided_alike_on_every_rank(world):
    assert run_ranks(paths_body, world) == [["fused", "unfused"]] * world
