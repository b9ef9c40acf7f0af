"""The mechanism checks under FSDP2 (Opacus' ``grad_sample_mode="ghost_fsdp"``: ``FSDP2Wrapper``
and ``FSDPOptimizerFastGradientClipping``) on a real 2-process gloo group. Every parameter is a
DTensor sharded over the ranks; each rank adds the noise to its own shard (σ C / W under mean
reduction) and tests it there, counts its own batch's rows (the model's per-sample norms) and
probes the model's ``get_clipping_coef`` (rank-local: it reads this rank's norms, no collective).
The ranks' findings are combined as the monitor's one exchange combines them (every rank's to
every rank, :func:`~privmon.callbacks.mechanism_audit.mechanism_figures`), so the ranks agree.

Over 5 seeds: a correct run is silent on every rank and trains bit-identically with and without
the checks; noise removed, noise halved, a loss that is not the criterion make_private returned
(no clipping) and a clip at 10 C with noise for C each alarm in 5 of 5. Collectives time out
after 30 s; the spawn fails the tests when the ranks outlive its deadline.
"""

from __future__ import annotations

import datetime
import re

import pytest
import torch
import torch.distributed as dist
from dp_sgd import train, with_noise_factor
from ranks import rank_results, spawned_results
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("opacus")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
MEETING_TIMEOUT = datetime.timedelta(seconds=120)
N, BATCH, SIGMA, CLIP, STEPS = 200, 20, 1.0, 0.1, 20  # q = 0.1; each rank's shard: 100 records
SEEDS = range(5)
FAULTS = ("noise removed", "noise halved", "not the DP criterion", "clip at 10 C")
ALARM = 1e-6  # the level of each statistical test: below any share of dp_alarm_delta = 1e-4


def _make(seed: int, *, nan: bool = False, reduction: str = "mean"):
    import warnings

    from opacus import PrivacyEngine
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    warnings.simplefilter("ignore")  # Opacus' secure-RNG and accountant notices
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 100)
    data = TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))
    if nan:  # one NaN input value of one record
        data.tensors[0][0, 0] = float("nan")
    net = FSDP2Wrapper(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    return PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
        data_loader=DataLoader(data, batch_size=BATCH),
        criterion=nn.CrossEntropyLoss(reduction=reduction),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        grad_sample_mode="ghost_fsdp",
        loss_reduction=reduction,
    )


def _run(seed: int, fault: str = "", *, watched: bool = True) -> dict:
    from privmon.audit import MechanismChecks

    model, optimizer, criterion, loader = _make(
        seed, nan=fault == "a NaN in one record", reduction="sum" if fault == "sum" else "mean"
    )
    if fault in ("noise removed", "noise halved"):  # the checks see the optimizer's σ
        with_noise_factor(optimizer, 0.0 if fault == "noise removed" else 0.5)
    checks = MechanismChecks(optimizer, module=model) if watched else None
    if fault == "clip at 10 C":  # the model clips at 10 C, the noise stays for C
        model.max_grad_norm = 10 * CLIP
    loss_of = nn.CrossEntropyLoss() if fault == "not the DP criterion" else criterion
    train(model, optimizer, loader, loss_of, steps=STEPS)
    found = () if checks is None else checks.mechanism()
    return {
        "kind": type(optimizer).__name__,
        "findings": found,
        "shards": {k: v.to_local().clone() for k, v in model.state_dict().items()},
    }


def _agreed(found: tuple) -> dict:
    """What every rank decides from all ranks' findings, as the monitor's exchange does."""
    from privmon.callbacks.mechanism_audit import mechanism_figures

    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"checks": found})
    figures, failures = mechanism_figures(ranks, alarm_delta=ALARM, step=STEPS)
    assert figures is not None
    return {"alarm": figures.violation, "causes": figures.causes, "failures": sorted(failures)}


def _refusals() -> dict:
    from privmon.audit import GradientCanaries, MechanismChecks

    _, optimizer, _, _ = _make(0)
    said = {"runnable": MechanismChecks.runnable(optimizer)}
    for name, make in (
        ("checks", lambda: MechanismChecks(optimizer)),
        ("canaries", lambda: GradientCanaries(optimizer, 10)),
        ("module", lambda: MechanismChecks(optimizer, module=nn.Linear(6, 3))),
    ):
        try:
            make().detach()
        except (TypeError, ValueError) as e:
            said[name] = str(e)
    return said


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=MEETING_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    with rank_results(rank, tmp) as out:
        out["unwatched"] = _run(0, watched=False)
        for fault in ("", *FAULTS):
            for seed in SEEDS:
                run = _run(seed, fault)
                run["agreed"] = _agreed(run["findings"])
                out[fault or "correct", seed] = run
        for case in ("a NaN in one record", "sum"):
            run = _run(0, case)
            run["agreed"] = _agreed(run["findings"])
            out[case] = run
        out["refusals"] = _refusals()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo-fsdp")
    out = spawned_results(_worker, tmp)  # fails, never hangs
    return out


def _by_name(run: dict) -> dict:
    return {f"{f.check}/{f.test}": f for f in run["findings"]}


def test_the_parameters_are_sharded_dtensors_of_the_fsdp_optimizer(ranks):
    for out in ranks:
        run = out["correct", 0]
        assert run["kind"] == "FSDPOptimizerFastGradientClipping"
        assert run["shards"]["_module.0.weight"].shape == (8, 6)  # of (16, 6)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_correct_fsdp_run_is_silent_on_every_rank_and_the_ranks_agree(ranks, seed):
    for rank, out in enumerate(ranks):
        run = out["correct", seed]
        found = _by_name(run)
        assert set(found) == {
            "clipping/probe",
            "clipping/finite",
            "noise/variance",
            "noise/repeat",
            "sampling/mean",
            "sampling/dispersion",
            "steps/count",
            "ledger/weights",
        }
        for name, f in found.items():
            assert not f.fired, (rank, f.evidence)
            assert f.p_value is None or f.p_value > 1e-3, (rank, name, f.evidence)
        assert run["agreed"] == {"alarm": False, "causes": (), "failures": []}
        assert found["clipping/probe"].evidence.startswith(
            f"clipping: a row of norm 100 C contributed at most C in 11 probes over {STEPS} steps"
        )
        noise = found["noise/variance"].evidence
        assert "(σ·C/2 = 0.05, on this rank's shard, 1 of 2;" in noise, noise
        ratio = float(re.search(r"the noise added has ([0-9.]+) ×", noise).group(1))
        assert ratio == pytest.approx(1.0, abs=0.1)  # each shard's noise is σ C / W, once
        assert "on this rank's shard" in found["sampling/mean"].evidence
        assert found["steps/count"].evidence == (
            f"steps: the accountant counted {STEPS} noised steps, {STEPS} were taken"
        )
    # each rank noised its own shard: different values, the same update of the shards it holds
    assert _by_name(ranks[0]["correct", seed])["noise/variance"].evidence != (
        _by_name(ranks[1]["correct", seed])["noise/variance"].evidence
    )


def test_under_sum_reduction_each_shard_is_tested_against_the_whole_sigma_c(ranks):
    """With loss_reduction="sum" Opacus does not divide each rank's noise by the world size."""
    for rank, out in enumerate(ranks):
        run = out["sum"]
        assert run["agreed"] == {"alarm": False, "causes": (), "failures": []}
        noise = _by_name(run)["noise/variance"].evidence
        assert "(σ·C = 0.1, on this rank's shard, 1 of 2;" in noise, noise
        ratio = float(re.search(r"the noise added has ([0-9.]+) ×", noise).group(1))
        assert ratio == pytest.approx(1.0, abs=0.1), (rank, noise)


def test_training_is_bit_identical_with_and_without_the_checks(ranks):
    for out in ranks:
        watched, alone = out["correct", 0]["shards"], out["unwatched"]["shards"]
        assert all(torch.equal(watched[k], alone[k]) for k in alone)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("fault", "ratio"), [("noise removed", 0.0), ("noise halved", 0.5)])
def test_noise_removed_or_halved_fires_every_ranks_noise_test(ranks, seed, fault, ratio):
    for out in ranks:
        run = out[fault, seed]
        found = _by_name(run)["noise/variance"]
        assert found.p_value < 1e-12, found.evidence
        said = float(re.search(r"the noise added has ([0-9.]+) ×", found.evidence).group(1))
        assert said == pytest.approx(ratio, abs=0.1)
        assert run["agreed"]["alarm"]
        assert any(c.startswith("noise: the noise added has") for c in run["agreed"]["causes"])
        assert not _by_name(run)["clipping/probe"].fired
    assert ranks[0][fault, seed]["agreed"] == ranks[1][fault, seed]["agreed"]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_loss_that_is_not_the_dp_criterion_is_no_clipping_and_fires(ranks, seed):
    for out in ranks:
        run = out["not the DP criterion", seed]
        found = _by_name(run)["clipping/probe"]
        assert found.fired
        assert found.evidence.startswith(
            "clipping: step 1 was not clipped: its backward pass computed no ghost clipping "
            f"coefficients ({STEPS} of {STEPS} steps)"
        )
        assert run["agreed"]["alarm"]
    assert (
        ranks[0]["not the DP criterion", seed]["agreed"]
        == (ranks[1]["not the DP criterion", seed]["agreed"])
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_clip_at_10_c_with_noise_for_c_fires_every_ranks_probe(ranks, seed):
    for out in ranks:
        run = out["clip at 10 C", seed]
        found = _by_name(run)["clipping/probe"]
        assert found.fired
        # the probe's row of norm 100 C = 10 keeps 10 C / (100 C) of it: 10 C = 1.0
        assert found.evidence == (
            "clipping: a row of norm 10 contributed 1.0, above C = 0.1 (step 1; 11 of 11 probes)"
        )
        assert run["agreed"]["alarm"]
    assert ranks[0]["clip at 10 C", seed]["agreed"] == ranks[1]["clip at 10 C", seed]["agreed"]


def test_a_nan_in_one_record_fires_every_ranks_finite_test_naming_the_record(ranks):
    """The record's NaN norm makes its clipping coefficient NaN and its rank's gradient NaN;
    FSDP's reduce-scatter carries it into every rank's shard. The rank whose batch held it
    names the row; a rank whose batch did not says so."""
    said = []
    for out in ranks:
        run = out["a NaN in one record"]
        found = _by_name(run)["clipping/finite"]
        assert found.fired
        assert run["agreed"]["alarm"]
        assert not any("repeats the noise" in c for c in run["agreed"]["causes"])
        said.append(found.evidence)
    named = [
        e
        for e in said
        if re.match(
            r"clipping: a per-sample gradient of record slot \d+ "
            r"was NaN at step \d+: it passed clipping unbounded",
            e,
        )
    ]
    assert named, said
    for e in said:
        assert e in named or e.startswith(
            "clipping: this rank's shard of the clipped sum was not finite at step "
        ), e
    assert ranks[0]["a NaN in one record"]["agreed"] == ranks[1]["a NaN in one record"]["agreed"]


def test_without_the_module_clipping_and_sampling_are_refused_saying_why(ranks):
    for out in ranks:
        said = out["refusals"]
        assert said["runnable"] == ("noise", "steps", "ledger")
        assert said["checks"].startswith(
            "optimizer is an Opacus FSDPOptimizerFastGradientClipping, on which the mechanism "
            "checks clipping, sampling cannot run (clipping: ghost clipping clips inside the "
            "loss's backward pass, in the model: pass module="
        ), said["checks"]
        assert (
            "under FSDP the model keeps each row's gradient norm: pass module=" in (said["checks"])
        )
        assert "Pass checks=('noise', 'steps', 'ledger') to run the others" in said["checks"]
        assert said["canaries"].startswith(
            "optimizer is an Opacus FSDPOptimizerFastGradientClipping, which GradientCanaries "
            "do not support: ghost clipping keeps no per-sample gradients."
        ), said["canaries"]
        assert said["module"].startswith(
            "module must be the GradSampleModuleFastGradientClippingFSDP that make_private "
            "returned with grad_sample_mode='ghost_fsdp'"
        )
