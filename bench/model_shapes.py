"""The GEMMs that dense transformer models run under tensor parallelism: what
``python -m bench.tune_gemm --models`` sweeps.

A decoder layer has four projections: q/k/v and gate/up are column-parallel (each rank
holds ``1/tp`` of the output columns, the input is whole), o and down are row-parallel
(each rank holds ``1/tp`` of the input columns: the two reduction points of a layer).
A shape is ``(M, K, N)`` of the forward product ``x @ W.t()`` on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int = 128

    def projections(self, tp: int) -> dict[str, tuple[int, int]]:
        """(K, N) of each projection on one of ``tp`` ranks."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        attn = self.heads * self.head_dim
        for name, width in (("q/k/v", qkv), ("gate/up", 2 * self.intermediate), ("o", attn),
                            ("down", self.intermediate)):  # fmt: skip
            if width % tp:
                raise ValueError(f"{name} width {width} does not split over {tp} ranks")
        return {
            "qkv": (self.hidden, qkv // tp),
            "gate_up": (self.hidden, 2 * self.intermediate // tp),
            "o": (attn // tp, self.hidden),
            "down": (self.intermediate // tp, self.hidden),
        }


# Published configurations (each model's config.json).
MODELS = {
    "llama3_8b": Model(4096, 14336, 32, 8),
    "llama3_70b": Model(8192, 28672, 64, 8),
    "qwen2.5_32b": Model(5120, 27648, 40, 8),
    "mistral_large": Model(12288, 28672, 96, 8),
}
TPS = (2, 4, 8)
DECODE_M = (1, 8, 16, 32, 64, 128, 256)
PREFILL_M = (777, 2048, 4096, 8192)


def shapes(models=tuple(MODELS), tps=TPS, ms=DECODE_M + PREFILL_M) -> list[tuple[int, int, int]]:
    """Every distinct (M, K, N) of ``models``' projections at ``tps``, for each M in ``ms``;
    ordered by M, then K, then N."""
    pairs = {kn for name in models for tp in tps for kn in MODELS[name].projections(tp).values()}
    return sorted((m, k, n) for m in ms for k, n in pairs)


def reduction_points(models=tuple(MODELS), tps=TPS) -> list[tuple[int, int]]:
    """Distinct (K, N) of the row-parallel projections (o, down): the GEMMs gemm_rs and
    gemm_ar fuse with their reduction."""
    return sorted(
        {
            kn
            for name in models
            for tp in tps
            for proj, kn in MODELS[name].projections(tp).items()
            if proj in ("o", "down")
        }
    )
