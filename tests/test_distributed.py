"""A real 2-process gloo group: each rank audits its shard; the figures equal one process's."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from privmon.callbacks import PrivacyEarlyStopping, PrivacyMonitor
from privmon.queries import LossQuery
from privmon.sinks import JsonlSink


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 2))


def _audit():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(360, 6, generator=g)
    y = torch.randint(0, 2, (360,), generator=g)  # random labels: only memorising fits them
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(200):  # overfit the member half so there is something to measure
        opt.zero_grad()
        F.cross_entropy(model(x[:180]), y[:180]).backward()
        opt.step()
    members = [(x[i : i + 30], y[i : i + 30]) for i in range(0, 180, 30)]
    nonmembers = [(x[i : i + 40], y[i : i + 40]) for i in range(180, 360, 40)]
    return model, members, nonmembers


def _monitor(model, members, nonmembers, logdir):
    return PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        strict=True,
        writer=str(logdir),
        sinks=[JsonlSink(f"{logdir}/checks.jsonl")],
        early_stopping=PrivacyEarlyStopping("loss/histogram", -1.0, use="value"),
    )


def _worker(rank, world, port, tmp):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        model, members, nonmembers = _audit()
        # contiguous shards, uneven on purpose: rank 0 gets 4 member batches, rank 1 gets 2
        m_shard = members[:4] if rank == 0 else members[4:]
        n_shard = nonmembers[:2] if rank == 0 else nonmembers[2:]
        mon = _monitor(model, m_shard, n_shard, f"{tmp}/ddp")
        stop = mon.step(100)
        rep = mon.last_report
        torch.save(
            {"scalars": rep.scalars, "top": list(rep.queries["loss"].top_records), "stop": stop},
            f"{tmp}/rank{rank}.pt",
        )
        mon.close()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_gloo_ranks_equal_one_process(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    model, members, nonmembers = _audit()
    single = _monitor(model, members, nonmembers, tmp_path / "single")
    single.step(100)
    expected = single.last_report
    single.close()
    assert r0["scalars"] == expected.scalars  # bit-for-bit: same records, same order
    assert r1["scalars"] == r0["scalars"]
    assert r0["top"] == list(expected.queries["loss"].top_records) == r1["top"]
    assert r0["stop"] is True and r1["stop"] is True  # both ranks stop together
    assert expected.scalars["privacy/loss/histogram/value"] > 0.1  # there is a leak to agree on
    lines = (tmp_path / "ddp" / "checks.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 100  # rank 0 alone writes
    assert len(list((tmp_path / "ddp").glob("events.out.tfevents.*"))) == 1
