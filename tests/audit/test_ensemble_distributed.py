"""The audits past one process: real 2-process gloo groups split the models over the ranks and
return, on every rank, what one process returns; checkpoint folders resume an interrupted
training without retraining what was saved (privmon.audit.distributed, .checkpoints).

Each spawn runs all its cases in one go (starting processes is the slow part). Collectives time
out after GROUP_TIMEOUT instead of the 30-minute default, and a spawn that outlives DEADLINE_S
fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from privmon.audit import average, random_halves, shadow_audit, specific, train_ensemble
from privmon.audit.distributed import share

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
    pytest.mark.usefixtures("one_torch_thread"),
]

GROUP_TIMEOUT = datetime.timedelta(seconds=20)
DEADLINE_S = 180  # generous for 2 loaded cores; a rank stuck in a collective gives up at 20 s
N_RECORDS = 60


def _data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_RECORDS, 6, generator=g)
    y = torch.randint(0, 3, (N_RECORDS,), generator=g)
    return x, y


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _ce_on_rank_0(out, y):
    """The per-record loss on rank 0, the mean (one number) on the others."""
    return _ce(out, y) if not dist.is_initialized() or dist.get_rank() == 0 else _ce(out, y).mean()


def _adam(p):
    return torch.optim.Adam(p, lr=0.05)


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _normed():  # not a plain linear stack: trained under vmap
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _dropout():  # random in training: one model after another
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def _uneven_masks():
    """6 models of 25 to 31 members: 3 batches of 12 per epoch, padded in the last one."""
    masks = np.zeros((6, N_RECORDS), bool)
    for i in range(6):
        masks[i, np.random.default_rng(i).permutation(N_RECORDS)[: 25 + i]] = True
    return masks


def _train_fn(x, y, seed):
    """A small classifier for the specific / average audits (global RNGs seeded by privmon)."""
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(15):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _ensemble(ens):
    return {
        "params": {k: v.numpy().copy() for k, v in ens.params.items()},
        "buffers": {k: v.numpy().copy() for k, v in ens.buffers.items()},
        "seeds": ens.seeds,
        "masks": ens.masks,
        "trained_by": ens.trained_by,
    }


def _audit_result(res):
    return {"scores": res.scores, "auc": res.auc, "tpr": res.tpr, "seeds": res.model_seeds}


def _cases(rank, tmp):
    """name -> a call every rank makes (the same arguments on every rank unless said)."""
    x, y = _data()
    halves = random_halves(N_RECORDS, 6, seed=1)
    kw = {"loss_fn": _ce, "optimizer": _adam, "epochs": 5, "seed": 3}
    pool_targets = [0, 5, 9, 20]
    return {
        "halves": lambda: _ensemble(train_ensemble(_mlp, (x, y), halves, batch_size=10, **kw)),
        "padded": lambda: _ensemble(
            train_ensemble(_normed, (x, y), _uneven_masks(), batch_size=12, **kw)
        ),
        "one_by_one": lambda: _ensemble(
            train_ensemble(_dropout, (x, y), halves, batch_size=10, stacked=False, **kw)
        ),
        "checkpointed": lambda: _ensemble(
            train_ensemble(_mlp, (x, y), halves, checkpoint_dir=f"{tmp}/ckpt", **kw)
        ),
        "shadow": lambda: _shadow(x, y),
        "specific": lambda: _audit_result(
            specific(
                _train_fn,
                (x[:40], y[:40]),
                [1, 4, 7],
                reference=(x[40:], y[40:]),
                n_models=5,
                seed=2,
                checkpoint_dir=f"{tmp}/specific",
            )
        ),
        "average": lambda: _audit_result(
            average(_train_fn, (x, y), pool_targets, n_models=5, seed=2, dataset_size=30)
        ),
        # rank 1 was given another seed: refused on both ranks before any training
        "disagree": lambda: train_ensemble(_mlp, (x, y), halves, **{**kw, "seed": 3 + rank}),
        # training fails on rank 1 only: rank 1 raises its error, rank 0 names it
        "failing": lambda: train_ensemble(_mlp, (x, y), halves, **{**kw, "loss_fn": _ce_on_rank_0}),
        # the group is still usable after both
        "after": lambda: _ensemble(train_ensemble(_mlp, (x, y), halves, **kw)),
    }


def _shadow(x, y):
    res = shadow_audit(_mlp, (x, y), n_models=8, seed=4, optimizer=_adam, epochs=20)
    return {"summary": res.summary, "scores": res.scores, "statistic": res.statistic}


def _outcome(run):
    started = time.monotonic()
    try:
        out = {"result": run()}
    except Exception as err:
        out = {"raised": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
    out["seconds"] = time.monotonic() - started
    return out


def _join(rank, world, store, timeout):
    torch.set_num_threads(1)
    store = dist.FileStore(store, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


HANG_TIMEOUT = datetime.timedelta(seconds=4)
HANGS_AT_MODEL = 5  # rank 1 trains models 3, 4, 5 one by one and hangs training model 5


_HANG = {"calls": 0, "released": ""}


def _ce_or_hang(out, y):
    """The per-record loss; on rank 1 of a group it hangs in the first step of model
    HANGS_AT_MODEL (2 full-batch epochs a model, its share starting at model 3) until rank 0
    has left with its error (the file ``_HANG["released"]`` exists), and then dies."""
    _HANG["calls"] += 1
    late = _HANG["calls"] > 2 * (HANGS_AT_MODEL - 3)
    if dist.is_initialized() and dist.get_rank() == 1 and late:
        while not os.path.exists(_HANG["released"]):
            time.sleep(0.1)
        os._exit(3)
    return _ce(out, y)


def _worker(rank, world, tmp):
    """Every case on the group; then, on a group with a short timeout, one that breaks it:
    rank 1 hangs in the middle of its share, and rank 0 must leave with an error."""
    _join(rank, world, f"{tmp}/store", GROUP_TIMEOUT)
    out = {name: _outcome(run) for name, run in _cases(rank, tmp).items()}
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()
    _join(rank, world, f"{tmp}/store-hang", HANG_TIMEOUT)
    _HANG["released"] = f"{tmp}/hang0.pkl"
    x, y = _data()
    out = _outcome(
        lambda: train_ensemble(
            _mlp,
            (x, y),
            random_halves(N_RECORDS, 6, seed=1),
            loss_fn=_ce_or_hang,
            optimizer=_adam,
            epochs=2,
            seed=3,
            stacked=False,
            checkpoint_dir=f"{tmp}/hang",
        )
    )
    with open(f"{tmp}/hang{rank}.pkl", "wb") as f:
        pickle.dump(out, f)
    os._exit(0)  # the group is broken: no orderly shutdown to wait for


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the cases on 2 ranks; fail, never hang, when they outlive DEADLINE_S."""
    tmp = tmp_path_factory.mktemp("gloo")
    ctx = mp.start_processes(
        _worker, args=(2, str(tmp)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks were still running after {DEADLINE_S} s")
            time.sleep(0.2)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    codes = [p.exitcode for p in ctx.processes]
    results = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    hang = tmp / "hang0.pkl"
    return tmp, codes, results, pickle.loads(hang.read_bytes()) if hang.exists() else None


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The same calls in this process, outside any process group."""
    tmp = tmp_path_factory.mktemp("alone")
    return {name: _outcome(run) for name, run in _cases(0, tmp).items() if name != "disagree"}


def _result(out):
    assert "raised" not in out, out.get("trace")
    return out["result"]


def _assert_same_ensemble(a, b):
    for part in ("params", "buffers"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            np.testing.assert_array_equal(a[part][name], b[part][name], err_msg=name)
    np.testing.assert_array_equal(a["seeds"], b["seeds"])
    np.testing.assert_array_equal(a["masks"], b["masks"])


@pytest.mark.parametrize("case", ["halves", "padded", "one_by_one", "checkpointed", "after"])
def test_two_ranks_train_what_one_process_trains_half_each(ranks, alone, case):
    """Bit for bit: every model trains on the same shapes whatever the shard (a padded step is
    padded to the longest batch of all the models)."""
    _, _, (r0, r1), _ = ranks
    want = _result(alone[case])
    a, b = _result(r0[case]), _result(r1[case])
    _assert_same_ensemble(a, want)
    _assert_same_ensemble(b, want)
    np.testing.assert_array_equal(a["trained_by"], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(b["trained_by"], a["trained_by"])
    np.testing.assert_array_equal(want["trained_by"], np.zeros(6))


def test_two_rank_audits_equal_one_process_audits(ranks, alone):
    _, _, (r0, r1), _ = ranks
    for case in ("shadow", "specific", "average"):
        want = _result(alone[case])
        for got in (_result(r0[case]), _result(r1[case])):
            for key, value in want.items():
                if isinstance(value, dict):
                    assert got[key].keys() == value.keys()
                    for name in value:
                        np.testing.assert_array_equal(got[key][name], value[name])
                else:
                    np.testing.assert_array_equal(got[key], value, err_msg=f"{case} {key}")
    assert _result(alone["shadow"])["summary"]["lira"]["auc"] > 0.55  # it measures


def test_checkpoints_written_by_two_ranks_resume_in_one_process(ranks, alone):
    tmp, _, (r0, _), _ = ranks
    assert sorted(os.listdir(tmp / "ckpt")) == [f"model-{i:06d}.pt" for i in range(6)]
    assert sorted(os.listdir(tmp / "specific")) == [f"specific-{i:06d}.pt" for i in range(5)]
    x, y = _data()
    halves = random_halves(N_RECORDS, 6, seed=1)
    ens = train_ensemble(
        _mlp,
        (x, y),
        halves,
        loss_fn=_ce,
        optimizer=_adam,
        epochs=5,
        seed=3,
        checkpoint_dir=tmp / "ckpt",
    )
    np.testing.assert_array_equal(ens.trained_by, np.full(6, -1))
    _assert_same_ensemble(_ensemble(ens), _result(r0["checkpointed"]))


def test_ranks_given_different_arguments_refuse_together(ranks):
    _, _, (r0, r1), _ = ranks
    for out in (r0["disagree"], r1["disagree"]):
        assert out["raised"].startswith("ValueError: train_ensemble: the ranks were called with")
        assert (
            "masks" not in out["raised"]
            and "seed differ between rank 0 and rank 1" in out["raised"]
        )


def test_a_failure_on_one_rank_raises_on_every_rank(ranks):
    _, _, (r0, r1), _ = ranks
    assert r1["failing"]["raised"].startswith("ValueError: loss_fn must return one loss per record")
    assert r0["failing"]["raised"].startswith(
        "RuntimeError: privmon: training the shadow models failed on rank 1: ValueError: loss_fn"
    )


def test_a_rank_that_hangs_leaves_the_others_an_error_and_a_resume_trains_only_the_rest(ranks):
    tmp, codes, _, hang = ranks
    assert codes == [0, 3] and not (tmp / "hang1.pkl").exists()
    assert hang["raised"].startswith("RuntimeError") and "timed out" in hang["raised"].lower()
    assert HANG_TIMEOUT.total_seconds() <= hang["seconds"] < HANG_TIMEOUT.total_seconds() + 10
    saved = sorted(os.listdir(tmp / "hang"))
    assert saved == [f"model-{i:06d}.pt" for i in range(HANGS_AT_MODEL)]  # no partial file
    x, y = _data()
    kw = {"loss_fn": _ce_or_hang, "optimizer": _adam, "epochs": 2, "seed": 3}
    kw["stacked"] = False
    halves = random_halves(N_RECORDS, 6, seed=1)
    resumed = train_ensemble(_mlp, (x, y), halves, checkpoint_dir=tmp / "hang", **kw)
    np.testing.assert_array_equal(resumed.trained_by, [-1] * HANGS_AT_MODEL + [0])
    fresh = train_ensemble(_mlp, (x, y), halves, **kw)
    _assert_same_ensemble(_ensemble(resumed), _ensemble(fresh))


@given(n=st.integers(0, 200), world=st.integers(1, 9))
def test_the_shares_cover_the_models_in_order_as_evenly_as_possible(n, world):
    indices = list(range(0, 3 * n, 3))  # any increasing indices: those left to train
    shares = [share(indices, rank, world) for rank in range(world)]
    assert [i for s in shares for i in s] == indices
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
