"""The templates' decode entries (``m_max`` <= 256 rows, some bounded by ``k_max``): each is
the first entry a shape of its own reaches, and on a GPU the fused op it configures is right
against float64 there: ag_gemm pushing its rows, gemm_ar's one-shot and two-shot, on 2 ranks.

(The interpreter's tests run the interpreter's template; these entries are the GPU's.)
"""

from __future__ import annotations

import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank

from overlap_kernels import tuning
from overlap_kernels.reference import judge_matmul, judge_reduced_matmul
from overlap_kernels.tuned import is_match_key

OPS = ("ag_gemm", "gemm_ar")
DECODE_ROWS = 256
WORLD = 2
N = 1000  # not a multiple of any entry's tile columns
K_PAST_BOUNDS = 3072  # past every entry's k_max, a multiple of every block_k


def decode_probes(op: str) -> list[tuple[dict, int, int]]:
    """(entry, m, k) for each decode entry of ``op``'s CUDA template: its largest M, and
    its k_max or a K past every bound (so that it, not a bounded one, matches)."""
    entries = tuning.load_template(op)["cuda"].get("shapes", [])
    return [(e, e["m_max"], e.get("k_max", K_PAST_BOUNDS)) for e in entries
            if e.get("m_max", DECODE_ROWS + 1) <= DECODE_ROWS]  # fmt: skip


def test_every_decode_entry_is_the_first_match_of_its_probe(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETER", False)  # (the cuda section, as on a GPU)
    tuning._template_values.cache_clear()
    try:
        for op in OPS:
            probes = decode_probes(op)
            assert len(probes) >= 4, (op, probes)
            for entry, m, k in probes:
                assert m % WORLD == 0, (op, m)  # (ag_gemm's rows split over the ranks)
                shape = tuning.shape_key(WORLD, m, k, N, torch.bfloat16)
                values = tuning.template_values(op, shape)
                fields = {f: v for f, v in entry.items() if not is_match_key(f, shape)}
                assert {f: values.get(f) for f in fields} == fields, (op, m, k)
    finally:
        tuning._template_values.cache_clear()


def decode_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    checked = 0
    for op in OPS:
        for _, m, k in decode_probes(op):
            seeded = torch.Generator(device=device).manual_seed(m * 7919 + k)
            if op == "ag_gemm":
                x_all = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=seeded)
                w = (
                    torch.randn(k, N, device=device, dtype=torch.bfloat16, generator=seeded)
                    / k**0.5
                )
                rows = m // world
                out = ok.ag_gemm(x_all[rank * rows : (rank + 1) * rows], w)
                verdict = judge_matmul(out, x_all, w)
            else:  # every rank's operands made on every rank, its own passed in
                xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=seeded)
                      for _ in range(world)]  # fmt: skip
                ws = [torch.randn(k, N, device=device, dtype=torch.bfloat16, generator=seeded) / k**0.5
                      for _ in range(world)]  # fmt: skip
                # (a fused path named: above one_shot_max_m "auto" may take the plain pair)
                shape = tuning.shape_key(world, m, k, N, torch.bfloat16)
                one_shot = m <= tuning.template_values(op, shape)["one_shot_max_m"]
                path = "one_shot" if one_shot else "two_shot"
                out = ok.gemm_ar(xs[rank], ws[rank], config={"path": path})
                verdict = judge_reduced_matmul(out, xs, ws)
            assert verdict.problem is None, f"{op} {m}x{k}x{N} on rank {rank}: {verdict.problem}"
            checked += 1
    dist.barrier()
    return checked


@gpu_ranks(worlds=(WORLD,))
def test_decode_entries_are_right_gpu(world, gpus, backend):
    expected = sum(len(decode_probes(op)) for op in OPS)
    assert run_on_gpus(decode_body, world, gpus, backend) == [expected] * world
