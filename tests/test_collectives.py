"""The plain paths' collective wrappers (runtime/collectives.py), without ranks."""

from __future__ import annotations

import pytest

from overlap_kernels.runtime import collectives


class _Work:
    """A c10d Work that is already done; it counts its waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        return True


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_reduction_op_keyword_reaches_the_collective(monkeypatch, backend):
    """A reduce-scatter passes its reduction as ``op=``, the name the wrappers
    give the calling op: it must reach the collective, started or not."""
    monkeypatch.setattr(collectives, "backend_of", lambda group: backend)
    work, calls = _Work(), []

    def run(*args, **kwargs):
        calls.append((args, kwargs))
        return work

    wait = collectives.start_collective(
        "gemm_rs", "reduce-scatter", run, "out", "full", op="SUM", group="g", timeout_s=5.0
    )
    assert calls == [(("out", "full"), {"op": "SUM", "group": "g", "async_op": True})]
    assert work.waits == 0  # started, not waited for
    wait()
    assert work.waits == 1
    collectives.collective("gemm_rs", "reduce-scatter", run, "out", "full", op="AVG", group="g")
    assert calls[-1][1]["op"] == "AVG"
