"""Shadow models trained as one vmapped ensemble equal the same models trained one by one
(privmon.audit.train_ensemble, privmon.models.Ensemble)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privmon.audit import Ensemble, random_halves, train_ensemble
from privmon.audit.seeding import training_seeds

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def per_record_ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def mlp(d=6, h=8, c=3, dtype=torch.float64):
    return lambda: nn.Sequential(
        nn.Linear(d, h, dtype=dtype), nn.Tanh(), nn.Linear(h, c, dtype=dtype)
    )


def normed_mlp(d=6, h=8, c=3, dtype=torch.float64):
    """Not a plain linear stack (LayerNorm): the stacked path runs it under vmap."""
    return lambda: nn.Sequential(
        nn.Linear(d, h, dtype=dtype),
        nn.LayerNorm(h, dtype=dtype),
        nn.Tanh(),
        nn.Linear(h, c, dtype=dtype),
    )


def data(n=40, d=6, c=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    y = torch.randint(0, c, (n,), generator=g)
    return x, y


def train_alone(model_fn, x, y, rows, *, seed, optimizer, epochs, batch_size):
    """The documented protocol written out as a plain PyTorch loop (the reference)."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    model = model_fn()
    torch.set_rng_state(state)
    opt = optimizer(list(model.parameters()))
    g = torch.Generator().manual_seed(seed)
    n = len(rows)
    for _ in range(epochs):
        order = torch.arange(n) if batch_size >= n else torch.randperm(n, generator=g)
        for b in order.split(batch_size):
            r = rows[b]
            opt.zero_grad()
            F.cross_entropy(model(x[r]), y[r]).backward()
            opt.step()
    return model


@pytest.mark.parametrize(
    ("optimizer", "batch_size", "masks_kind"),
    [
        (lambda p: torch.optim.Adam(p, lr=0.05), 7, "halves"),  # shuffled mini-batches
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3), None, "uneven"),
        (lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1), 30, "uneven"),
        (lambda p: torch.optim.RMSprop(p, lr=0.01), 10, "uneven"),  # 3 batches, padded last
    ],
)
@pytest.mark.parametrize(("stacked", "model_fn"), [(True, mlp), (True, normed_mlp), (False, mlp)])
def test_each_model_equals_training_it_alone(optimizer, batch_size, masks_kind, stacked, model_fn):
    x, y = data()
    if masks_kind == "halves":
        masks = random_halves(40, 5, seed=3)
    else:  # 21 to 26 members: 1 batch per epoch at batch size None or 30, 3 at 10
        masks = np.random.default_rng(0).random((5, 40)) < 0.6
        masks[:, :21] = True
        masks[:, 26:] = False
    ens = train_ensemble(
        model_fn(),
        (x, y),
        masks,
        loss_fn=per_record_ce,
        optimizer=optimizer,
        epochs=12,
        batch_size=batch_size,
        seed=11,
        stacked=stacked,
    )
    assert len(ens) == 5 and np.array_equal(ens.masks, masks)
    np.testing.assert_array_equal(ens.seeds, training_seeds(11, 5))
    bs = int(masks.sum(1).max()) if batch_size is None else batch_size
    for i in range(5):
        rows = torch.nonzero(torch.as_tensor(masks[i])).squeeze(1)
        alone = train_alone(
            model_fn(),
            x,
            y,
            rows,
            seed=int(ens.seeds[i]),
            optimizer=optimizer,
            epochs=12,
            batch_size=bs,
        )
        mine = ens.model(i)
        for (name, p), (_, q) in zip(
            alone.named_parameters(), mine.named_parameters(), strict=True
        ):
            torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-10, msg=name)
        assert not torch.equal(alone[0].weight, ens.model((i + 1) % 5)[0].weight)
        assert ens(x).shape == (5, 40, 3)
        torch.testing.assert_close(ens(x)[i], alone(x).detach(), rtol=1e-9, atol=1e-10)


def test_float32_full_batch_adam_matches_to_float_tolerance():
    x, y = data(n=120, d=16, c=10, dtype=torch.float32)
    masks = random_halves(120, 8, seed=0)
    opt = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    kw = {"loss_fn": per_record_ce, "optimizer": opt, "epochs": 60, "seed": 5}
    ens = train_ensemble(mlp(16, 32, 10, torch.float32), (x, y), masks, **kw)
    seq = train_ensemble(mlp(16, 32, 10, torch.float32), (x, y), masks, stacked=False, **kw)
    for name in ens.params:
        torch.testing.assert_close(ens.params[name], seq.params[name], rtol=1e-4, atol=1e-4)
    assert ens.params["0.weight"].shape == (8, 32, 16)


def test_hooks_parametrizations_and_bias_free_layers():
    """A model with a forward hook or a parametrized weight is more than its Linear layers, and
    a Linear without bias has nothing to stack: the stacked models still compute what each
    model computes alone."""
    x, y = data()
    masks = random_halves(40, 3, seed=0)
    kw = {**SGD, "epochs": 4}

    def hooked():
        model = mlp()()
        model[0].register_forward_hook(lambda mod, inp, out: 2.0 * out)
        return model

    def weight_normed():
        model = mlp()()
        nn.utils.parametrizations.weight_norm(model[0])
        return model

    def no_bias():  # a linear stack too, without a bias term to stack
        d = torch.float64
        return nn.Sequential(
            nn.Linear(6, 8, bias=False, dtype=d), nn.ReLU(), nn.Linear(8, 3, dtype=d)
        )

    for model_fn in (hooked, weight_normed, no_bias):
        ens = train_ensemble(model_fn, (x, y), masks, **kw)
        alone = train_ensemble(model_fn, (x, y), masks, stacked=False, **kw)
        for i in range(3):
            want = alone.model(i)(x).detach()
            torch.testing.assert_close(ens(x)[i], want, rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(ens.model(i)(x).detach(), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    "layers",
    [
        # an activation on the inputs (which must stay untouched), consecutive and trailing
        # activations, an Identity, a narrow output layer
        lambda d: [
            nn.ReLU(),
            nn.Linear(6, 20, dtype=d),
            nn.Tanh(),
            nn.ReLU(),
            nn.Linear(20, 8, dtype=d),
            nn.ReLU(),
            nn.ReLU(),
            nn.Identity(),
            nn.Linear(8, 3, dtype=d),
            nn.Sigmoid(),
        ],
        # a ReLU after an activation whose backward reads its output; a wide output layer
        lambda d: [nn.Linear(6, 20, dtype=d), nn.GELU(), nn.ReLU(), nn.Linear(20, 17, dtype=d)],
        lambda d: [
            nn.Linear(6, 8, bias=False, dtype=d),
            nn.LeakyReLU(0.1),
            nn.Linear(8, 3, dtype=d),
            nn.ReLU(),
        ],
    ],
)
def test_linear_stacks_train_as_each_model_alone(layers):
    """The linear-stack path (batched products, its backward written by hand) gives every
    model the parameters autograd gives it alone, whatever the activations around its layers."""
    x, y = data(c=3)
    x_before = x.clone()
    masks = random_halves(40, 4, seed=2)
    model_fn = lambda: nn.Sequential(*layers(torch.float64))  # noqa: E731
    kw = {
        "loss_fn": per_record_ce,
        "optimizer": lambda p: torch.optim.Adam(p, lr=0.05),
        "epochs": 6,
        "batch_size": 7,
        "seed": 1,
    }
    ens = train_ensemble(model_fn, (x, y), masks, **kw)
    alone = train_ensemble(model_fn, (x, y), masks, stacked=False, **kw)
    assert torch.equal(x, x_before)
    for name in alone.params:
        torch.testing.assert_close(ens.params[name], alone.params[name], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ens(x), alone(x), rtol=1e-9, atol=1e-10)
    assert torch.equal(x, x_before)


def test_a_loss_may_modify_the_outputs_in_place_where_autograd_allows_it():
    """The stacked outputs are an autograd node's, as the model's own are: a loss that clamps
    them in place trains each model as it trains alone, and where the backward reads the
    outputs (a trailing ReLU on a wide layer) autograd refuses it in both paths alike."""
    x, y = data()
    masks = random_halves(40, 3, seed=0)

    def clamped_ce(out, t):
        out.clamp_(-0.5, 0.5)
        return per_record_ce(out, t)

    kw = {**SGD, "loss_fn": clamped_ce, "epochs": 3, "batch_size": 7}
    d = torch.float64
    for width in (3, 20):  # the narrow and the wide product
        model_fn = lambda w=width: nn.Sequential(  # noqa: E731
            nn.Linear(6, 8, dtype=d), nn.ReLU(), nn.Linear(8, w, dtype=d)
        )
        ens = train_ensemble(model_fn, (x, y), masks, **kw)
        alone = train_ensemble(model_fn, (x, y), masks, stacked=False, **kw)
        for name in alone.params:
            torch.testing.assert_close(ens.params[name], alone.params[name], rtol=1e-9, atol=0)
    trailing_relu = lambda: nn.Sequential(nn.Linear(6, 20, dtype=d), nn.ReLU())  # noqa: E731
    for stacked in (True, False):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            train_ensemble(trailing_relu, (x, y), masks, stacked=stacked, **kw)


@pytest.mark.parametrize("width", [3, 20])
@pytest.mark.parametrize("trailing", [[nn.ReLU], []])
def test_the_stack_leaves_autograds_gradient_alone(width, trailing):
    """A per-record sum of the outputs hands the stack an expanded gradient (one value seen
    through every element); a trailing ReLU must not write its mask into it."""
    x, y = data()
    masks = random_halves(40, 3, seed=0)
    d = torch.float64
    model_fn = lambda: nn.Sequential(  # noqa: E731
        nn.Linear(6, 8, dtype=d), nn.Tanh(), nn.Linear(8, width, dtype=d), *(m() for m in trailing)
    )
    kw = {**SGD, "loss_fn": lambda out, t: out.sum(1), "epochs": 3}
    ens = train_ensemble(model_fn, (x, y), masks, **kw)
    alone = train_ensemble(model_fn, (x, y), masks, stacked=False, **kw)
    for name in alone.params:
        torch.testing.assert_close(ens.params[name], alone.params[name], rtol=1e-9, atol=1e-12)


def test_random_halves():
    m = random_halves(11, 200, seed=1)
    assert m.shape == (200, 11) and m.dtype == bool
    assert (m.sum(axis=1) == 5).all()
    share = m.mean(axis=0)
    assert ((share > 0.3) & (share < 0.6)).all()  # each record in about 5/11 of the models
    np.testing.assert_array_equal(m, random_halves(11, 200, seed=1))
    assert not np.array_equal(m, random_halves(11, 200, seed=2))
    # models are independent: not all the same half
    assert len({tuple(r) for r in m}) > 150
    # more models extend fewer: a checkpoint folder of 200 models serves the first 120
    np.testing.assert_array_equal(random_halves(11, 120, seed=1), m[:120])
    with pytest.raises(ValueError, match="n_records must be an integer >= 2"):
        random_halves(1, 3, seed=0)


SGD = {"loss_fn": per_record_ce, "optimizer": lambda p: torch.optim.SGD(p, lr=0.1), "seed": 0}


def test_a_loss_drawing_random_numbers_is_seeded_and_leaves_the_rngs_alone():
    x, y = data()
    masks = random_halves(40, 3, seed=0)

    def noisy_ce(out, t):
        return per_record_ce(out + 0.1 * torch.randn_like(out), t)

    kw = {**SGD, "loss_fn": noisy_ce, "epochs": 3}
    trained = []
    for caller_seed in (1, 2):
        torch.manual_seed(caller_seed)
        state = torch.get_rng_state()
        trained.append(train_ensemble(mlp(), (x, y), masks, **kw))
        assert torch.equal(torch.get_rng_state(), state)
    for name in trained[0].params:
        assert torch.equal(trained[0].params[name], trained[1].params[name])


def test_batchnorm_with_padded_batches_needs_stacked_false():
    x, y = data()
    uneven = np.zeros((3, 40), bool)
    for i, n in enumerate((20, 24, 28)):
        uneven[i, :n] = True
    d = torch.float64
    bn = lambda: nn.Sequential(  # noqa: E731
        nn.Linear(6, 8, dtype=d), nn.BatchNorm1d(8, track_running_stats=False, dtype=d)
    )
    kw = {**SGD, "epochs": 2}
    with pytest.raises(ValueError, match="batch statistics would include the padding"):
        train_ensemble(bn, (x, y), uneven, **kw)
    even = random_halves(40, 3, seed=0)  # no padding: the same models either way
    ens = train_ensemble(bn, (x, y), even, **kw)
    alone = train_ensemble(bn, (x, y), even, stacked=False, **kw)
    for name in alone.params:
        torch.testing.assert_close(ens.params[name], alone.params[name], rtol=1e-9, atol=1e-12)


def test_global_rng_is_left_untouched_and_result_reproduces():
    x, y = data()
    masks = random_halves(40, 3, seed=0)
    kw = {**SGD, "epochs": 3, "batch_size": 5}
    torch.manual_seed(99)
    state = torch.get_rng_state()
    a = train_ensemble(mlp(), (x, y), masks, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    b = train_ensemble(mlp(), (x, y), masks, **kw)
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name])


def test_models_with_dropout_or_batchnorm_need_stacked_false():
    x, y = data()
    masks = random_halves(40, 3, seed=0)
    kw = {"loss_fn": per_record_ce, "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}
    x = x.float()
    drop = lambda: nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))  # noqa: E731
    bn = lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))  # noqa: E731
    with pytest.raises(ValueError, match=r"Dropout\(p=0.5\).*stacked=False"):
        train_ensemble(drop, (x, y), masks, epochs=1, seed=0, **kw)
    with pytest.raises(ValueError, match="BatchNorm1d with running statistics"):
        train_ensemble(bn, (x, y), masks, epochs=1, seed=0, **kw)
    functional = lambda: _FunctionalDropout()  # noqa: E731
    with pytest.raises(ValueError, match=r"draws random numbers in training \(e.g. F.dropout\)"):
        train_ensemble(functional, (x, y), masks, epochs=1, seed=0, **kw)
    for fn in (drop, bn):  # one by one: works, reproducibly (dropout seeded per model)
        a = train_ensemble(fn, (x, y), masks, epochs=2, batch_size=8, seed=0, stacked=False, **kw)
        b = train_ensemble(fn, (x, y), masks, epochs=2, batch_size=8, seed=0, stacked=False, **kw)
        out = a(x)
        assert out.shape == (3, 40, 3) and torch.equal(out, b(x))
        torch.testing.assert_close(out[1], a.model(1)(x).detach())


class _FunctionalDropout(nn.Module):
    """Dropout called in forward, not as a module: only the first forward can tell."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.dropout(self.linear(x), 0.5, training=self.training))


def test_argument_errors():
    x, y = data()
    masks = random_halves(40, 3, seed=0)
    kw = {**SGD, "epochs": 1}
    with pytest.raises(ValueError, match="loss_fn must return one loss per record"):
        train_ensemble(mlp(), (x, y), masks, **{**kw, "loss_fn": F.cross_entropy})
    uneven = masks.copy()
    uneven[0, :] = True
    with pytest.raises(ValueError, match="same number"):
        train_ensemble(mlp(), (x, y), uneven, batch_size=5, **kw)
    empty = masks.copy()
    empty[1] = False
    with pytest.raises(ValueError, match="model 1 has no training record"):
        train_ensemble(mlp(), (x, y), empty, **kw)
    with pytest.raises(ValueError, match=r"masks must be a boolean array of shape \(3, 40\)"):
        train_ensemble(mlp(), (x, y), masks[:, :39], **kw)
    with pytest.raises(ValueError, match=r"shape \(k, 40\), one row per model, got shape \(40,\)"):
        train_ensemble(mlp(), (x, y), masks[0], **kw)
    with pytest.raises(ValueError, match="epochs must be an integer >= 1"):
        train_ensemble(mlp(), (x, y), masks, **{**kw, "epochs": 0})
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        train_ensemble(mlp(), (x, y), masks, batch_size=0, **kw)
    with pytest.raises(ValueError, match="data must be a pair"):
        train_ensemble(mlp(), x, masks, **kw)
    with pytest.raises(TypeError, match="optimizer must be callable"):
        train_ensemble(mlp(), (x, y), masks, **{**kw, "optimizer": "adam"})
    with pytest.raises(TypeError, match=r"model_fn must return a torch\.nn\.Module"):
        train_ensemble(lambda: 3, (x, y), masks, **kw)
    ens = train_ensemble(mlp(), (x, y), masks, **kw)
    assert isinstance(ens, Ensemble) and "n_models=3" in repr(ens)
    with pytest.raises(ValueError, match=r"i must be an index in \[0, 2\]"):
        ens.model(3)


@pytest.mark.parametrize("model_fn", [mlp, normed_mlp])  # the linear stack and vmap
@pytest.mark.parametrize("batch_size", [None, 10])  # full batch; a short, padded last batch
def test_a_bad_record_poisons_only_the_models_that_train_on_it(model_fn, batch_size):
    """Padded rows repeat the model's own record and never reach the loss: a record whose loss
    is not finite (here an infinite input) spoils the models trained on it, as alone, and no
    other model (padding once reused record 0 in every padded model)."""
    x, y = data()
    x[0] = float("inf")
    masks = np.zeros((6, 40), bool)
    for i, n in enumerate((21, 22, 23, 24, 25, 26)):  # unequal: every model but one padded
        masks[i, 1 : n + 1] = True
    masks[[2, 5], 0] = True
    kw = {**SGD, "epochs": 3, "batch_size": batch_size}
    ens = train_ensemble(model_fn(), (x, y), masks, **kw)
    alone = train_ensemble(model_fn(), (x, y), masks, stacked=False, **kw)
    for i in range(6):
        finite = all(bool(torch.isfinite(p[i]).all()) for p in ens.params.values())
        assert finite == (i not in (2, 5)), i
        if finite:
            for name, p in alone.params.items():
                torch.testing.assert_close(ens.params[name][i], p[i], rtol=1e-9, atol=1e-10)


def _recipe_kw(**changes):
    return {**SGD, "epochs": 3, "batch_size": 7, **changes}


def test_a_checkpoint_folder_resumes_without_retraining_what_was_saved(tmp_path):
    x, y = data()
    masks = random_halves(40, 5, seed=0)
    full = train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw())
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"model-{i:06d}.pt" for i in range(5)]  # no partial file left
    np.testing.assert_array_equal(full.trained_by, np.zeros(5))
    for i in (1, 3):
        (tmp_path / f"model-{i:06d}.pt").unlink()
    resumed = train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw())
    np.testing.assert_array_equal(resumed.trained_by, [-1, 0, -1, 0, -1])
    for name in full.params:  # bit for bit: the same models, loaded or trained again
        assert torch.equal(resumed.params[name], full.params[name])
    # a folder of more models serves fewer: the first three are models 0-2 of the five
    few = train_ensemble(mlp(), (x, y), masks[:3], checkpoint_dir=tmp_path, **_recipe_kw())
    np.testing.assert_array_equal(few.trained_by, [-1, -1, -1])
    assert torch.equal(few.params["0.weight"], full.params["0.weight"][:3])
    # saved in a stack, resumed one by one: refused, the recipe says how they were trained
    with pytest.raises(ValueError, match=r"training \('epochs=3, batch_size=7, stacked=True'"):
        train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw(stacked=False))


def zero_bias_mlp():
    """The architecture of mlp(), initialised otherwise."""
    model = mlp()()
    nn.init.zeros_(model[0].bias)
    return model


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epochs": 4}, r"training \('epochs=3, .*'epochs=4, .*\) differs"),
        ({"optimizer": lambda p: torch.optim.SGD(p, lr=0.2)}, r"optimizer \(.*'lr', '0.1'"),
        ({"optimizer": lambda p: torch.optim.Adam(p, lr=0.1)}, r"torch.optim.adam.Adam"),
        ({"loss_fn": lambda out, t: per_record_ce(out, t)}, r"loss_fn \('.*per_record_ce'"),
        ({"model_fn": mlp(h=9)}, r"model \("),
        ({"model_fn": zero_bias_mlp}, r"another model 0: its init is '[0-9a-f]{12}\.\.\.'"),
        ({"seed": 1}, r"another model 0: its seed is \d+, here \d+; its init is"),
        ({"x": 1.0}, r"data \('[0-9a-f]{12}\.\.\.' in the folder, '[0-9a-f]{12}\.\.\.' here\)"),
        ({"masks": 1}, r"another model 0: its mask differs in \d+ of 40 entries"),
    ],
)
def test_a_checkpoint_folder_of_another_recipe_is_refused_naming_what_differs(
    tmp_path, change, message
):
    x, y = data()
    masks = random_halves(40, 3, seed=0)
    train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw())
    model_fn = change.pop("model_fn", mlp())
    if "x" in change:
        x = x.clone()
        x[5, 2] += change.pop("x")
    if "masks" in change:
        masks = masks.copy()
        masks[0] = masks[change.pop("masks")]
    with pytest.raises(ValueError, match=message):
        train_ensemble(model_fn, (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw(**change))


def test_checkpoint_files_are_loaded_without_running_code(tmp_path):
    """``weights_only=True``: a file holding an arbitrary object is refused, not unpickled."""
    x, y = data()
    masks = random_halves(40, 2, seed=0)
    train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw())
    torch.save(
        {"format": "privmon.audit.checkpoint/1", "payload": _Payload()},
        tmp_path / "model-000000.pt",
    )
    with pytest.raises(ValueError, match=r"model-000000.pt cannot be read \(UnpicklingError"):
        train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw())
    assert not _Payload.unpickled
    (tmp_path / "model-000001.pt").write_bytes(b"truncated")
    (tmp_path / "model-000000.pt").unlink()
    with pytest.raises(ValueError, match=r"model-000001.pt cannot be read .* remove it"):
        train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw())
    (tmp_path / "model-000001.pt").unlink()
    torch.save({"format": "privmon.audit.checkpoint/1"}, tmp_path / "model-000001.pt")
    with pytest.raises(ValueError, match="is not a privmon model checkpoint of model 1"):
        train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw())
    (tmp_path / "model-000001.pt").unlink()
    ens = train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path, **_recipe_kw())
    np.testing.assert_array_equal(ens.trained_by, [0, 0])


class _Payload:
    unpickled = False

    def __setstate__(self, state):
        type(self).unpickled = True


def test_checkpoint_and_distributed_argument_errors(tmp_path):
    x, y = data()
    masks = random_halves(40, 2, seed=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="checkpoint_dir must be a directory path, but"):
        train_ensemble(mlp(), (x, y), masks, checkpoint_dir=tmp_path / "file", **_recipe_kw())
    with pytest.raises(TypeError, match=r"checkpoint_dir must be a directory path \(str or"):
        train_ensemble(mlp(), (x, y), masks, checkpoint_dir=3, **_recipe_kw())
    with pytest.raises(ValueError, match="distributed must be True or False"):
        train_ensemble(mlp(), (x, y), masks, distributed="yes", **_recipe_kw())
