"""The mechanism checks and the gradient canaries under distributed Opacus, on a real 2-process
gloo group: Opacus' ``DistributedDPOptimizer`` adds the noise on rank 0 and sums the ranks'
gradients, so the canaries join on rank 0 only and the noise is tested there; each rank counts
the rows of its own shard. A correct run fires nothing on either rank and leaves both ranks with
the same weights and canary scores; halved noise fires rank 0's noise test; the full shard at
every step, or each rank sampling the whole dataset, fires each rank's sampling test. Per-layer
clipping under DDP (Opacus' ``SimpleDistributedPerLayerOptimizer``: its steps clip, noise and
sum as the flat one's do) is checked the same way: a correct run is silent, halved noise fires
rank 0's noise test, an unclipped layer bound every rank's clipping probe. So is ghost clipping
under DDP (``DistributedDPOptimizerFastGradientClipping``, the model given as ``module=``): a
correct run is silent, a clip at 10 C with noise for C fires every rank's probe.

The ranks run every case in one spawn (starting processes is the slow part); collectives time
out after 30 s, and test_distributed's spawn fails the tests when the ranks outlive its deadline.
"""

from __future__ import annotations

import datetime
import re

import pytest
import torch
import torch.distributed as dist
from dp_sgd import N, make_private, toy_data, toy_net, train, with_noise_factor
from ranks import rank_results, spawned_results
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("opacus")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
MEETING_TIMEOUT = datetime.timedelta(seconds=120)
BATCH, STEPS = 20, 30  # q = 0.1; each rank's shard holds 100 records
CASES = (
    "correct",
    "noise-half",
    "full-shard",
    "whole-dataset",
    "per-layer",
    "per-layer-noise-half",
    "per-layer-unclipped",
    "ghost",
    "ghost-clip-10C",
)
LAYER_BOUNDS = [0.5] * 4  # C = 1


def _run(case: str, rank: int) -> dict:
    import warnings

    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    from privmon.audit import GradientCanaries, MechanismChecks

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    data, net = toy_data(1), toy_net()
    per_layer, ghost = case.startswith("per-layer"), case.startswith("ghost")
    made = make_private(
        DPDDP(net),
        net,
        data,
        batch=BATCH,
        noise_multiplier=1.0,
        max_grad_norm=LAYER_BOUNDS if per_layer else 1.0,
        clipping="per_layer" if per_layer else "flat",
        **({"criterion": nn.CrossEntropyLoss(), "grad_sample_mode": "ghost"} if ghost else {}),
    )
    model, optimizer, loss_of, loader = made if ghost else (*made[:2], _cross_entropy, made[2])
    if case.endswith("noise-half"):
        with_noise_factor(optimizer, 0.5)
    if case == "full-shard":  # the user's own loader: the whole shard at every step
        shard = torch.arange(rank, N, 2)
        loader = DataLoader(TensorDataset(*(t[shard] for t in data.tensors)), batch_size=N)
    if case == "whole-dataset":  # each rank Poisson-samples all N records at q, not its shard
        from opacus.data_loader import DPDataLoader

        loader = DPDataLoader.from_data_loader(DataLoader(data, batch_size=BATCH))
    if case == "per-layer-unclipped":  # the layers' bounds lifted after make_private: C stays 1
        optimizer.max_grad_norms = [1e6] * 4
    if case == "ghost-clip-10C":  # the model clips at 10 C, the noise stays for C
        model.max_grad_norm = 10.0
    # (the canaries cannot join a per-layer or ghost step: no per-sample bound of C to add at)
    canaries = (
        MechanismChecks(optimizer, module=model if ghost else None)
        if per_layer or ghost
        else GradientCanaries(optimizer, 100, seed=0)
    )
    train(model, optimizer, loader, loss_of, steps=STEPS)
    canaries_kept = not (per_layer or ghost)
    return {
        "kind": type(optimizer).__name__,
        "findings": {f"{f.check}/{f.test}": f for f in canaries.mechanism()},
        "scores": canaries.scores() if canaries_kept else None,
        "counts": canaries.sample_counts if canaries_kept else None,
        "weights": {k: v.clone() for k, v in net.state_dict().items()},
    }


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _refusals() -> dict:
    """What the canaries say on per-layer clipping under DDP (Opacus'
    SimpleDistributedPerLayerOptimizer: each layer has a bound of its own), and which
    mechanism checks run there (all five)."""
    import warnings

    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    from privmon.audit import GradientCanaries, MechanismChecks

    warnings.simplefilter("ignore")
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    data = TensorDataset(torch.randn(N, 6), torch.randint(0, 3, (N,)))
    _, optimizer, _ = PrivacyEngine().make_private(
        module=DPDDP(net),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=1.0,
        max_grad_norm=[0.5] * 4,
        clipping="per_layer",
    )
    said = {"kind": type(optimizer).__name__, "runnable": MechanismChecks.runnable(optimizer)}
    try:
        GradientCanaries(optimizer, 10, sample_rate=0.1)
    except ValueError as e:
        said["canaries"] = str(e)
    return said


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=MEETING_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    with rank_results(rank, tmp) as out:
        for case in CASES:
            out[case] = _run(case, rank)
        out["refusals"] = _refusals()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo-checks")
    out = spawned_results(_worker, tmp)  # fails, never hangs
    return out


def test_a_correct_distributed_run_fires_nothing_and_the_ranks_agree(ranks):
    for rank, out in enumerate(ranks):
        for name, f in out["correct"]["findings"].items():
            assert not f.fired, (rank, f.evidence)
            assert f.p_value is None or f.p_value > 1e-3, (rank, name, f.evidence)
    rank0, rank1 = ranks[0]["correct"], ranks[1]["correct"]
    assert rank0["findings"]["steps/count"].evidence == (
        f"steps: the accountant counted {STEPS} noised steps, {STEPS} were taken"
    )
    assert rank1["findings"]["noise/variance"].evidence == (
        "noise: not tested on rank 1: Opacus adds the noise on rank 0, which tests it"
    )
    assert "this rank's shard" in rank1["findings"]["sampling/mean"].evidence
    for key, value in rank0["weights"].items():  # the same update on both ranks
        assert torch.equal(value, rank1["weights"][key]), key
    for a, b in zip(rank0["scores"], rank1["scores"], strict=True):
        assert a.tobytes() == b.tobytes()
    assert rank0["counts"].sum() > 0 and rank1["counts"].sum() == 0  # added on rank 0 only


@pytest.mark.parametrize("case", ["noise-half", "per-layer-noise-half"])
def test_halved_noise_fires_rank_0s_noise_test(ranks, case):
    found = ranks[0][case]["findings"]["noise/variance"]
    assert found.p_value < 1e-6
    ratio = float(re.search(r"the noise added has ([0-9.]+) ×", found.evidence).group(1))
    assert ratio == pytest.approx(0.5, abs=0.03)
    assert ranks[1][case]["findings"]["noise/variance"].p_value == 1.0
    others = [f for name, f in ranks[0][case]["findings"].items() if name != "noise/variance"]
    assert not any(f.fired or (f.p_value or 1) < 1e-3 for f in others)


def test_the_whole_shard_at_every_step_fires_each_ranks_sampling_test(ranks):
    for out in ranks:
        found = out["full-shard"]["findings"]["sampling/mean"]
        assert found.p_value < 1e-6
        assert found.evidence == (
            f"sampling: 100 rows in each of {STEPS} steps, the accountant assumes "
            "Binomial(100, 0.1) on this rank's shard"
        )


def test_each_rank_sampling_the_whole_dataset_fires_its_sampling_test(ranks):
    """About 20 rows a step where the shard of 100 gives 10: above the largest shard size the
    expected batch size allows (⌈N₁/W⌉ = 105)."""
    for out in ranks:
        found = out["whole-dataset"]["findings"]["sampling/mean"]
        assert found.p_value < 1e-6, found.evidence
        said = re.fullmatch(
            rf"sampling: ([0-9.]+) rows per step \(variance [0-9.]+\) over {STEPS} steps, the "
            r"accountant assumes Binomial\(100, 0\.1\) on this rank's shard \(mean 10\.0, "
            r"variance 9\.0\)",
            found.evidence,
        )
        assert said, found.evidence
        assert float(said[1]) == pytest.approx(20, abs=2)


def test_per_layer_clipping_under_ddp_is_checked_and_a_correct_run_is_silent(ranks):
    for rank, out in enumerate(ranks):
        run = out["per-layer"]
        assert run["kind"] == "SimpleDistributedPerLayerOptimizer"
        for name, f in run["findings"].items():
            assert not f.fired, (rank, f.evidence)
            assert f.p_value is None or f.p_value > 1e-3, (rank, name, f.evidence)
        assert "contributed at most C" in run["findings"]["clipping/probe"].evidence
        assert "this rank's shard" in run["findings"]["sampling/mean"].evidence
    for key, value in ranks[0]["per-layer"]["weights"].items():
        assert torch.equal(value, ranks[1]["per-layer"]["weights"][key]), key


def test_an_unclipped_layer_bound_under_ddp_fires_every_ranks_clipping_probe(ranks):
    for out in ranks:
        found = out["per-layer-unclipped"]["findings"]["clipping/probe"]
        assert found.fired
        assert found.evidence.startswith(
            "clipping: a row of norm 100 contributed 100.0, above C = 1.0 (step 1;"
        )


def test_ghost_clipping_under_ddp_is_checked_silent_when_correct_and_a_clip_at_10_c_fires(ranks):
    for rank, out in enumerate(ranks):
        correct, faulty = out["ghost"], out["ghost-clip-10C"]
        assert correct["kind"] == "DistributedDPOptimizerFastGradientClipping"
        for name, f in correct["findings"].items():
            assert not f.fired, (rank, f.evidence)
            assert f.p_value is None or f.p_value > 1e-3, (rank, name, f.evidence)
        found = faulty["findings"]["clipping/probe"]
        assert found.fired
        assert found.evidence.startswith(
            "clipping: a row of norm 100 contributed 10.0, above C = 1.0 (step 1;"
        ), found.evidence
    for key, value in ranks[0]["ghost"]["weights"].items():
        assert torch.equal(value, ranks[1]["ghost"]["weights"][key]), key


def test_the_canaries_refuse_per_layer_clipping_under_ddp_advising_what_runs(ranks):
    flat = (
        "flat clipping (make_private(clipping='flat'), grad_sample_mode 'hooks', 'functorch', "
        "'ew' or 'no_op', on one process or under DDP: DistributedDPOptimizer)"
    )
    for out in ranks:
        said = out["refusals"]
        assert said["kind"] == "SimpleDistributedPerLayerOptimizer"
        assert said["runnable"] == ("clipping", "noise", "sampling", "steps", "ledger")
        assert f"GradientCanaries run with {flat}." in said["canaries"]
        assert said["canaries"].endswith(
            "On it MechanismChecks(optimizer, checks=('clipping', 'noise', 'sampling', 'steps', "
            "'ledger')) runs."
        ), said["canaries"]
