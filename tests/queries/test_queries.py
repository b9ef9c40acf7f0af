"""Tests for privmon.queries: values against hand computations and brute force, batch conventions,
hook hygiene, module state left untouched, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privmon.queries import (
    CallableQuery,
    ConfidenceQuery,
    CorrectnessQuery,
    DiscriminatorQuery,
    EntropyQuery,
    HiddenLayerQuery,
    HybridQuery,
    LogitConfidenceQuery,
    LossQuery,
    ModifiedEntropyQuery,
    MultiDiscriminatorQuery,
    NearestGeneratedQuery,
    Query,
)


class FixedLogits(nn.Module):
    """Returns the input as logits (the 'model' is the identity), so logits are chosen by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + 0 * self.dummy


def _classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(8, 3)
    )


def _data(n: int = 17, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _mentr_ref(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Song & Mittal eq. 8 straight from probabilities (float64)."""
    out = []
    for row, label in zip(p, y, strict=True):
        s = -(1 - row[label]) * math.log(row[label])
        s -= sum(row[i] * math.log(1 - row[i]) for i in range(len(row)) if i != label)
        out.append(s)
    return np.array(out)


# --- classifier queries: values -------------------------------------------------------------------


def test_modified_entropy_matches_eq8_on_hand_probabilities():
    p = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5], [0.05, 0.9, 0.05]])
    y = np.array([0, 0, 2, 2])
    logits = torch.tensor(np.log(p))
    got = ModifiedEntropyQuery(FixedLogits().double())((logits, torch.tensor(y)))
    assert got.dtype == torch.float64 and got.shape == (4,)
    np.testing.assert_allclose(got.numpy(), _mentr_ref(p, y), rtol=1e-12)
    # first row by hand: -(0.3) ln 0.7 - 0.2 ln 0.8 - 0.1 ln 0.9
    hand = -0.3 * math.log(0.7) - 0.2 * math.log(0.8) - 0.1 * math.log(0.9)
    assert got[0].item() == pytest.approx(hand, rel=1e-12)


def test_modified_entropy_extremes_are_finite():
    q = ModifiedEntropyQuery(FixedLogits())
    logits = torch.tensor([[100.0, -100.0], [100.0, -100.0], [20.0, -20.0], [0.0, float("-inf")]])
    s = q((logits, torch.tensor([0, 1, 1, 0])))
    assert torch.isfinite(s).all()
    assert s[0].item() == 0.0  # perfectly confident and correct
    assert s[3].item() == 0.0  # probabilities exactly [1, 0], correct
    # confident wrong: both logs clipped at 1e-30 -> -2 log(1e-30)
    assert s[1].item() == pytest.approx(-2 * math.log(1e-30), rel=1e-6)
    # [20, -20] wrong: log p_y = -40 and log(1 - p_0) = -40 exactly (no clipping), float32 input
    assert s[2].item() == pytest.approx(80.0, rel=1e-5)
    # monotone: more confident wrong -> larger
    s2 = q((torch.tensor([[2.0, -2.0], [4.0, -4.0]]), torch.tensor([1, 1])))
    assert s2[1] > s2[0] > 0


def test_logit_confidence_values_and_stability():
    logits = torch.tensor([[1.0, -0.5, 0.3], [0.2, 2.0, -1.0], [50.0, -50.0, -50.0]])
    y = torch.tensor([0, 2, 0])
    s = LogitConfidenceQuery(FixedLogits())((logits, y))
    p = F.softmax(logits.double(), dim=1)[torch.arange(3), y]
    ref = torch.log(p / (1 - p))
    torch.testing.assert_close(s[:2].double(), ref[:2], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(s).all()
    assert s[2].item() == pytest.approx(100.0 - math.log(2.0), rel=1e-6)
    two = LogitConfidenceQuery(FixedLogits())((torch.tensor([[50.0, -50.0]]), torch.tensor([0])))
    assert two.item() == pytest.approx(100.0)


def test_loss_confidence_correctness_entropy_values():
    model = _classifier().eval()
    x, y = _data()
    with torch.no_grad():
        z = model(x)
    torch.testing.assert_close(LossQuery(model)((x, y)), F.cross_entropy(z, y, reduction="none"))
    p = F.softmax(z, dim=1)
    torch.testing.assert_close(ConfidenceQuery(model)((x, y)), p[torch.arange(len(y)), y])
    corr = CorrectnessQuery(model)((x, y))
    assert corr.dtype == torch.float32 and set(corr.tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(corr, (z.argmax(1) == y).float())
    assert CorrectnessQuery(model).discrete and not LossQuery(model).discrete
    torch.testing.assert_close(EntropyQuery(model)((x, y)), -(p * p.log()).sum(1))
    mentr = ModifiedEntropyQuery(model)((x, y)).double()
    ref = _mentr_ref(p.double().numpy(), y.numpy())
    np.testing.assert_allclose(mentr.numpy(), ref, rtol=1e-5)


def test_binary_single_logit_is_expanded():
    z = torch.tensor([[1.5], [-0.7], [3.0]])
    y = torch.tensor([1.0, 0.0, 0.0])  # float 0/1 labels, BCE convention
    loss = LossQuery(FixedLogits())((z, y))
    torch.testing.assert_close(
        loss, F.binary_cross_entropy_with_logits(z.squeeze(1), y, reduction="none")
    )
    lc = LogitConfidenceQuery(FixedLogits())((z, y))
    torch.testing.assert_close(lc, torch.tensor([1.5, 0.7, -3.0]))


# --- batch conventions and label errors -----------------------------------------------------------


def test_batch_conventions_give_same_scores():
    model = _classifier().eval()
    x, y = _data()
    q = LossQuery(model)
    ref = q((x, y))
    for batch in (
        [x, y],
        (x, y, torch.arange(len(y))),
        {"x": x, "y": y},
        {"input": x, "label": y},
        {"inputs": x, "labels": y},
        {"x": x, "target": y.numpy()},
        (x, y.tolist()),
    ):
        torch.testing.assert_close(q(batch), ref)
    qt = LossQuery(model, transform=lambda b: (b["img"], b["cls"]))
    torch.testing.assert_close(qt({"img": x, "cls": y}), ref)
    # tensor batch for a label-free query equals the tuple and dict forms
    h = HiddenLayerQuery(model, model[0])
    torch.testing.assert_close(h(x), h((x, y)))
    torch.testing.assert_close(h(x), h({"input_ids": x}))


def test_input_dict_from_transform_is_passed_as_kwargs():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, *, features, scale):
            return self.lin(features) * scale

    m = KW().eval()
    x, y = _data()
    q = LossQuery(m, transform=lambda b: ({"features": b[0], "scale": 2.0}, b[1]))
    with torch.no_grad():
        ref = F.cross_entropy(m.lin(x) * 2.0, y, reduction="none")
    torch.testing.assert_close(q((x, y)), ref)


@pytest.mark.parametrize(
    "cls",
    [
        LossQuery,
        ConfidenceQuery,
        CorrectnessQuery,
        EntropyQuery,
        ModifiedEntropyQuery,
        LogitConfidenceQuery,
    ],
)
def test_missing_labels_raise(cls):
    model = _classifier().eval()
    x, _ = _data()
    q = cls(model)
    for batch in (x, (x,), {"x": x}):
        with pytest.raises(ValueError, match="labels"):
            q(batch)


def test_bad_labels_and_batches_raise():
    q = LossQuery(_classifier().eval())
    x, y = _data()
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\]"):
        q((x, torch.full_like(y, 3)))
    with pytest.raises(ValueError, match="labels"):
        q((x, y[:-1]))
    with pytest.raises(ValueError, match="labels"):
        q((x, y.float() + 0.5))
    with pytest.raises(ValueError, match="input keys"):
        q({"features": x})
    with pytest.raises(ValueError, match="transform"):
        q("not a batch")
    with pytest.raises(ValueError, match="transform"):
        LossQuery(_classifier(), transform=lambda b: b[0])((x, y))


def test_constructor_validation_names_argument():
    m = _classifier()
    with pytest.raises(ValueError, match="model"):
        LossQuery("nope")
    with pytest.raises(ValueError, match="name"):
        LossQuery(m, name="")
    with pytest.raises(ValueError, match="transform"):
        LossQuery(m, transform=3)
    with pytest.raises(ValueError, match="layer"):
        HiddenLayerQuery(m, nn.Linear(2, 2))
    with pytest.raises(ValueError, match="layer"):
        HiddenLayerQuery(m, "nonexistent")
    with pytest.raises(ValueError, match="output"):
        DiscriminatorQuery(m, output="sigmoid")
    with pytest.raises(ValueError, match="eps"):
        DiscriminatorQuery(m, output="prob", eps=0.7)
    with pytest.raises(ValueError, match="reduce"):
        MultiDiscriminatorQuery([m, m], reduce="mean")
    with pytest.raises(ValueError, match="discriminators"):
        MultiDiscriminatorQuery([])
    with pytest.raises(ValueError, match="n_samples"):
        NearestGeneratedQuery(m, latent_dim=2, n_samples=0)
    with pytest.raises(ValueError, match="chunk"):
        NearestGeneratedQuery(m, latent_dim=2, chunk=True)
    with pytest.raises(ValueError, match="latent_dim"):
        NearestGeneratedQuery(m)
    with pytest.raises(ValueError, match="latent_dim"):
        NearestGeneratedQuery(m, latent_dim=(4, 0))
    with pytest.raises(ValueError, match="sample_fn"):
        NearestGeneratedQuery(m, sample_fn=5)
    with pytest.raises(ValueError, match="nearest_query"):
        HybridQuery(DiscriminatorQuery(m), lambda b: b)
    with pytest.raises(ValueError, match="fn"):
        CallableQuery(3, name="c")
    with pytest.raises(TypeError):
        LossQuery(m, "loss")  # keyword-only


# --- hidden layer ---------------------------------------------------------------------------------


def test_hidden_layer_values_and_hook_removed():
    model = _classifier().eval()
    x, _ = _data()
    layer = model[1]  # BatchNorm output, followed by an in-place ReLU
    q = HiddenLayerQuery(model, layer)
    assert q.modules == (model,)
    with torch.no_grad():
        q.prepare(torch.device("cpu"))
        assert not layer._forward_hooks
        h = q(x)
        assert not layer._forward_hooks  # only attached during the call
        q.release()
        ref = model[1](model[0](x))
    assert h.shape == (17, 8)
    torch.testing.assert_close(h, ref)  # pre-ReLU: the clone is not overwritten in place
    assert not layer._forward_hooks and not model._forward_hooks
    by_name = HiddenLayerQuery(model, "1")(x)
    torch.testing.assert_close(by_name, ref)


def test_hidden_layer_flattens_and_removes_hook_on_error():
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).eval()
    x = torch.randn(4, 1, 6, 6)
    h = HiddenLayerQuery(conv, conv[0])(x)
    assert h.shape == (4, 32)
    with torch.no_grad():
        torch.testing.assert_close(h, conv[0](x).reshape(4, -1))
    with pytest.raises(RuntimeError):
        HiddenLayerQuery(conv, conv[0])(torch.randn(4, 1, 2, 2))  # conv fails on a 2x2 input
    assert not conv[0]._forward_hooks


# --- GAN queries ----------------------------------------------------------------------------------


def _disc(seed: int, sigmoid: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(4, 6), nn.LeakyReLU(0.2), nn.Linear(6, 1)]
    return nn.Sequential(*layers, *([nn.Sigmoid()] if sigmoid else [])).eval()


def _gen(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4)).eval()


def test_discriminator_logit_and_prob():
    x = torch.randn(9, 4)
    d = _disc(0)
    s = DiscriminatorQuery(d)(x)
    assert s.shape == (9,)
    with torch.no_grad():
        torch.testing.assert_close(s, d(x).squeeze(1))
    d_sig = _disc(0, sigmoid=True)
    sp = DiscriminatorQuery(d_sig, output="prob")(x)
    torch.testing.assert_close(sp, s, rtol=1e-4, atol=1e-4)  # logit(sigmoid(z)) = z
    # saturated sigmoid is clamped, never inf
    big = DiscriminatorQuery(d_sig, output="prob", eps=1e-6)(x * 1e6)
    assert torch.isfinite(big).all() and big.abs().max() <= math.log((1 - 1e-6) / 1e-6) + 1e-3


def test_multi_discriminator_max_and_vector():
    x = torch.randn(9, 4)
    ds = [_disc(0), _disc(1), _disc(2)]
    vec = MultiDiscriminatorQuery(ds, reduce="vector")(x)
    mx = MultiDiscriminatorQuery(ds)(x)
    with torch.no_grad():
        ref = torch.cat([d(x) for d in ds], dim=1)
    assert vec.shape == (9, 3) and mx.shape == (9,)
    torch.testing.assert_close(vec, ref)
    torch.testing.assert_close(mx, ref.max(dim=1).values)
    q = MultiDiscriminatorQuery(nn.ModuleList(ds))
    assert q.name == "disc_max" and len(q.modules) == 3 and q.higher_is_member


def test_nearest_generated_matches_brute_force_with_chunks():
    gen = _gen()
    x = torch.randn(11, 4)
    q = NearestGeneratedQuery(gen, n_samples=10, latent_dim=2, chunk=3)
    torch.manual_seed(5)
    with torch.no_grad():
        q.prepare(torch.device("cpu"))
    samples = q.samples.numpy().astype(np.float64)
    assert samples.shape == (10, 4)
    d = q(x)
    ref = np.sqrt(((x.numpy()[:, None, :] - samples[None]) ** 2).sum(-1)).min(1)
    np.testing.assert_allclose(d.numpy(), ref, rtol=1e-5, atol=1e-6)
    # a generated sample is at distance ~0 from itself (no matrix-product cancellation)
    self_d = q(torch.as_tensor(samples[:4], dtype=torch.float32))
    assert self_d.abs().max().item() < 1e-6
    # samples really come from the generator, drawn chunk by chunk with the global RNG
    torch.manual_seed(5)
    with torch.no_grad():
        zs = [torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 2), torch.randn(1, 2)]
        ref_samples = gen(torch.cat(zs))
    np.testing.assert_allclose(samples, ref_samples.numpy(), rtol=1e-5, atol=1e-6)
    q.release()
    assert q.samples is None
    with pytest.raises(RuntimeError, match="prepare"):
        q(x)


def test_nearest_generated_determinism_and_sample_fn():
    gen = _gen()
    x = torch.randn(7, 2, 2)  # flattened to 4 values per record
    q = NearestGeneratedQuery(gen, n_samples=50, latent_dim=(2,), chunk=16)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        q.prepare(None)
        runs.append(q(x))
        q.release()
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    assert not torch.equal(runs[0], runs[2])

    fixed = torch.randn(6, 4)
    qf = NearestGeneratedQuery(None, sample_fn=lambda n, device: fixed[:n].to(device), n_samples=6)
    assert qf.modules == ()
    qf.prepare(torch.device("cpu"))
    ref = torch.cdist(x.reshape(7, 4).double(), fixed.double()).min(1).values
    torch.testing.assert_close(qf(x).double(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="values per record"):
        qf(torch.randn(3, 5))
    bad = NearestGeneratedQuery(gen, sample_fn=lambda n, device: fixed, n_samples=4)
    with pytest.raises(ValueError, match="sample_fn"):
        bad.prepare(None)


def test_hybrid_columns_equal_the_two_queries():
    d, gen = _disc(0), _gen()
    x = torch.randn(8, 4)
    dq = DiscriminatorQuery(d)
    nq = NearestGeneratedQuery(gen, n_samples=20, latent_dim=2, chunk=7)
    hq = HybridQuery(dq, nq)
    assert hq.modules == (d, gen) and hq.name == "hybrid"
    torch.manual_seed(0)
    hq.prepare(torch.device("cpu"))
    s = hq((x, torch.zeros(8)))
    assert s.shape == (8, 2)
    torch.testing.assert_close(s[:, 0], dq(x))
    torch.testing.assert_close(s[:, 1], nq(x))
    hq.release()
    assert nq.samples is None
    # shared modules are listed once
    assert HybridQuery(dq, DiscriminatorQuery(d, name="d2")).modules == (d,)


def test_callable_query():
    m = _classifier().eval()
    x, y = _data()
    q = CallableQuery(lambda b: np.arange(len(b[0])), name="idx", modules=m, discrete=True)
    s = q((x, y))
    assert isinstance(q, Query) and q.modules == (m,) and q.discrete
    assert s.dtype == torch.float32 and s.tolist() == list(map(float, range(17)))
    v = CallableQuery(lambda b: b[0][:, :2].double(), name="vec")((x, y))
    assert v.shape == (17, 2) and v.dtype == torch.float64
    with pytest.raises(ValueError, match="shape"):
        CallableQuery(lambda b: torch.zeros(2, 2, 2), name="bad")(x)


# --- module state is never touched ----------------------------------------------------------------


def _state(mods):
    flags = [sub.training for m in mods for sub in m.modules()]
    tensors = [t.clone() for m in mods for t in m.state_dict().values()]
    hooks = [
        (len(sub._forward_hooks), len(sub._forward_pre_hooks)) for m in mods for sub in m.modules()
    ]
    return flags, tensors, hooks


def _assert_same(a, b):
    assert a[0] == b[0] and a[2] == b[2]
    assert len(a[1]) == len(b[1])
    for s, t in zip(a[1], b[1], strict=True):
        assert torch.equal(s, t)


def test_queries_leave_modules_untouched():
    clf = _classifier()
    x, y = _data()
    clf.train()
    with torch.no_grad():
        clf(x)  # non-trivial running stats
    clf.eval()
    gen, ds = _gen(), [_disc(0), _disc(1)]
    # a module set to train mode inside (mixed flags) must stay mixed: queries never call .eval()
    clf[3].train()
    gan_x = torch.randn(17, 4)
    queries = [
        (LossQuery(clf), (x, y)),
        (ConfidenceQuery(clf), (x, y)),
        (CorrectnessQuery(clf), (x, y)),
        (EntropyQuery(clf), (x, y)),
        (ModifiedEntropyQuery(clf), (x, y)),
        (LogitConfidenceQuery(clf), (x, y)),
        (HiddenLayerQuery(clf, clf[1]), (x, y)),
        (DiscriminatorQuery(ds[0]), gan_x),
        (MultiDiscriminatorQuery(ds, reduce="vector"), gan_x),
        (
            HybridQuery(
                DiscriminatorQuery(ds[1]),
                NearestGeneratedQuery(gen, n_samples=30, latent_dim=2, chunk=4),
            ),
            gan_x,
        ),
    ]
    for q, batch in queries:
        mods = q.modules
        before = _state(mods)
        with torch.no_grad():
            q.prepare(torch.device("cpu"))
            s = q(batch)
            q(batch)
            q.release()
        _assert_same(before, _state(mods))
        assert s.is_floating_point() and s.shape[0] == len(
            batch[0] if isinstance(batch, tuple) else batch
        )
        assert torch.isfinite(s).all()
        assert s.device == torch.device("cpu")


def test_higher_is_member_flags():
    m = _classifier()
    assert LossQuery(m).higher_is_member is False
    assert ModifiedEntropyQuery(m).higher_is_member is False
    assert ConfidenceQuery(m).higher_is_member is True
    assert DiscriminatorQuery(_disc(0)).higher_is_member is True
    assert NearestGeneratedQuery(_gen(), latent_dim=2).higher_is_member is False
    assert HiddenLayerQuery(m, m[0]).higher_is_member is None
    assert MultiDiscriminatorQuery([_disc(0)], reduce="vector").higher_is_member is None
