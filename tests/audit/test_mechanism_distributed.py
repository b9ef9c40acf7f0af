"""The mechanism checks and the gradient canaries under distributed Opacus, on a real 2-process
gloo group: Opacus' ``DistributedDPOptimizer`` adds the noise on rank 0 and sums the ranks'
gradients, so the canaries join on rank 0 only and the noise is tested there; each rank counts
the rows of its own shard. A correct run fires nothing on either rank and leaves both ranks with
the same weights and canary scores; halved noise fires rank 0's noise test; the full shard at
every step, or each rank sampling the whole dataset, fires each rank's sampling test.

The ranks run every case in one spawn (starting processes is the slow part); collectives time
out after 30 s, and test_distributed's spawn fails the tests when the ranks outlive its deadline.
"""

from __future__ import annotations

import datetime
import pickle
import re

import pytest
import torch
import torch.distributed as dist
from ranks import spawn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("opacus")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
MEETING_TIMEOUT = datetime.timedelta(seconds=120)
N, BATCH, STEPS = 200, 20, 30  # q = 0.1; each rank's shard holds 100 records
CASES = ("correct", "noise-half", "full-shard", "whole-dataset")


def _run(case: str, rank: int) -> dict:
    import warnings

    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    from privmon.audit import GradientCanaries

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=DPDDP(net),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    if case == "noise-half":
        original = optimizer.add_noise

        def add_noise() -> None:
            sigma = optimizer.noise_multiplier
            optimizer.noise_multiplier = sigma / 2
            try:
                original()
            finally:
                optimizer.noise_multiplier = sigma

        optimizer.add_noise = add_noise
    if case == "full-shard":  # the user's own loader: the whole shard at every step
        shard = torch.arange(rank, N, 2)
        loader = DataLoader(TensorDataset(*(t[shard] for t in data.tensors)), batch_size=N)
    if case == "whole-dataset":  # each rank Poisson-samples all N records at q, not its shard
        from opacus.data_loader import DPDataLoader

        loader = DPDataLoader.from_data_loader(DataLoader(data, batch_size=BATCH))
    canaries = GradientCanaries(optimizer, 100, seed=0)
    steps = 0
    while steps < STEPS:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
            if steps == STEPS:
                break
    return {
        "findings": {f"{f.check}/{f.test}": f for f in canaries.mechanism()},
        "scores": canaries.scores(),
        "counts": canaries.sample_counts,
        "weights": {k: v.clone() for k, v in net.state_dict().items()},
    }


def _refusals() -> dict:
    """What the checks and the canaries say on per-layer clipping under DDP (Opacus'
    SimpleDistributedPerLayerOptimizer, which clips and noises inside the backward pass), and
    that what they advise runs: flat clipping under DDP."""
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
    for name, make in (
        ("checks", lambda: MechanismChecks(optimizer)),
        ("canaries", lambda: GradientCanaries(optimizer, 10, sample_rate=0.1)),
    ):
        try:
            make()
        except ValueError as e:
            said[name] = str(e)
    return said


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=MEETING_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    out = {}
    try:
        for case in CASES:
            out[case] = _run(case, rank)
        out["refusals"] = _refusals()
    finally:
        with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
            pickle.dump(out, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo-checks")
    spawn(_worker, tmp)
    out = []
    for rank in (0, 1):
        with open(tmp / f"rank{rank}.pkl", "rb") as f:
            out.append(pickle.load(f))
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


def test_halved_noise_fires_rank_0s_noise_test(ranks):
    found = ranks[0]["noise-half"]["findings"]["noise/variance"]
    assert found.p_value < 1e-6
    ratio = float(re.search(r"the noise added has ([0-9.]+) ×", found.evidence).group(1))
    assert ratio == pytest.approx(0.5, abs=0.03)
    assert ranks[1]["noise-half"]["findings"]["noise/variance"].p_value == 1.0


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


def test_per_layer_clipping_under_ddp_is_refused_advising_only_what_runs(ranks):
    """All five checks are refused there: the refusal does not say "pass checks=() to run the
    others", and names where they run (flat clipping under DDP: the cases above)."""
    flat = (
        "flat clipping (make_private(clipping='flat'), grad_sample_mode 'hooks', 'functorch', "
        "'ew' or 'no_op', on one process or under DDP: DistributedDPOptimizer)"
    )
    for out in ranks:
        said = out["refusals"]
        assert said["kind"] == "SimpleDistributedPerLayerOptimizer"
        assert said["runnable"] == ()
        assert said["checks"].startswith(
            "optimizer is an Opacus SimpleDistributedPerLayerOptimizer, on which the mechanism "
            "checks clipping, noise, sampling, steps, ledger cannot run (clipping: it clips and "
            "noises each layer inside the backward pass"
        )
        assert said["checks"].endswith(
            ". None of the checks asked for runs on it (checks=('clipping', 'noise', "
            "'sampling', 'steps', 'ledger')); clipping, noise, sampling, steps, ledger run with "
            f"{flat} or per-layer clipping on one process (clipping='per_layer')."
        )
        assert "to run the others" not in said["checks"]
        assert said["canaries"].endswith(
            f". GradientCanaries run with {flat}. No mechanism check runs on it either."
        )
