"""The group-relative advantage, which each algorithm file holds as its own copy (tests/test_skeleton.py checks that the
copies are identical; grpo.py's adds the leave-one-out baseline): against a numpy reference, on near-flat groups, and
the multi-reward aggregation."""

import importlib

import numpy as np
import pytest
import torch

ALGOS = pytest.mark.parametrize(
    "algo",
    [importlib.import_module(f"algos.{name}") for name in ("awm", "crd", "dgpo", "elbo_grpo", "grpo", "nft")],
    ids=lambda m: m.__name__,
)


def _np_advantages(r, k, std, loo, clip):
    r = np.asarray(r, dtype=np.float64).reshape(-1, k)
    out = np.zeros_like(r)
    for g in range(r.shape[0]):
        for i in range(k):
            base = (r[g].sum() - r[g, i]) / (k - 1) if loo else r[g].mean()
            scale = {"group": r[g].std() + 1e-4, "global": r.std() + 1e-4}[std]  # flow_grpo's + 1e-4
            out[g, i] = 0.0 if r[g].std() < 1e-8 else (r[g, i] - base) / scale
    return np.clip(out, -clip, clip).ravel() if clip else out.ravel()


@pytest.mark.parametrize(  # RLOO's leave-one-out baseline: grpo.py's copy only
    "algo, loo",
    [(m, loo) for m in ALGOS.args[1] for loo in ((False, True) if m.__name__ == "algos.grpo" else (False,))],
    ids=lambda v: v.__name__ if hasattr(v, "__name__") else f"loo={v}",
)
@pytest.mark.parametrize("std", ["group", "global"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_group_advantages_match_numpy(algo, std, loo, clip):
    rng = np.random.default_rng(0)
    r = rng.normal(size=12)
    r[4:8] = 0.3  # a zero-variance group -> advantage 0
    extra = {"leave_one_out": loo} if loo else {}
    adv = algo.group_advantages(torch.tensor(r), 4, std=std, clip=clip, **extra)
    np.testing.assert_allclose(adv.numpy(), _np_advantages(r, 4, std, loo, clip), atol=1e-6)
    assert torch.isfinite(adv).all() and (adv[4:8] == 0).all()


@ALGOS
def test_near_flat_group_gets_near_zero_advantages(algo):
    """Rewards equal up to float32 rounding must not become +-1 advantages (a 1e-8 floor made them exactly that)."""
    base = torch.tensor([0.7, 0.7, 0.7, 0.7, 0.1, 0.9, 0.4, 0.6])
    r = base.clone()
    r[1] = torch.nextafter(r[1], torch.tensor(1.0))  # one float32 ulp (6e-8) apart
    adv = algo.group_advantages(r, 4)
    assert adv[:4].abs().max() < 1e-3
    # a real spread is barely touched by the eps: std 0.29 -> relative change 3e-4
    rest = base[4:].double()
    torch.testing.assert_close(adv[4:].double(), (rest - rest.mean()) / (rest.std(unbiased=False) + 1e-4), atol=1e-6, rtol=0)


@ALGOS
def test_aggregate_advantages_sum_and_gdpo(algo):
    """ "sum" is the advantage of the weighted total; "gdpo" normalises each reward in its groups, then the weighted sum
    over the batch, so a reward of a 100x larger scale does not drown the other."""
    g = torch.Generator().manual_seed(0)
    scores = {"a": torch.rand(16, generator=g), "b": 100 * torch.rand(16, generator=g)}
    weights = {"a": 1.0, "b": 0.5}
    total = scores["a"] + 0.5 * scores["b"]
    torch.testing.assert_close(algo.aggregate_advantages(scores, weights, 4, "sum"), algo.group_advantages(total, 4))
    combined = algo.group_advantages(scores["a"], 4) + 0.5 * algo.group_advantages(scores["b"], 4)
    expected = (combined - combined.mean()) / (combined.std(unbiased=False) + 1e-4)  # flow_grpo's + 1e-4, as the group path
    torch.testing.assert_close(algo.aggregate_advantages(scores, weights, 4, "gdpo", clip=10.0), expected)
    with pytest.raises(Exception, match="unknown advantage aggregation"):
        algo.aggregate_advantages(scores, weights, 4, "max")
