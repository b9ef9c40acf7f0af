"""Every Python snippet of the user guide (``docs/guide/*.md``) runs, so a snippet that fails
fails the build, and prints what its output block says.

The conventions (output blocks, markers, the platform whose figures the blocks hold) and the
harness: ``tests/snippets.py``. This module holds the guide's setups; each names the page whose
snippet it serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import tiny_unet
from snippets import (
    ROOT,
    SETUPS,
    Group,
    census_splits,
    chains,
    check,
    checked,
    digits,
    dp_model,
    dp_private,
    groups,
    mismatches,
    mlp,
    pages,
    parse,
    problems,
    run,
    snippet_setup,
    tiny_lm,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GUIDE = ROOT / "docs" / "guide"
CHAINS = pages(*sorted(GUIDE.glob("*.md")))
GROUPS = groups(CHAINS)


def test_the_guide_has_snippets_and_each_marker_is_known():
    assert sum(len(c.snippets) for c in CHAINS) >= 18
    assert not problems(CHAINS, SETUPS)


def test_a_marker_reaches_its_snippet():
    """The marker is read from the line just before the fence, the output block from the lines
    just after it (a failing parse would leave every snippet unmarked and the setups unused, or
    every output unchecked)."""
    used = {c.setup for c in CHAINS} - {None}
    assert used == {name for name, fn in SETUPS.items() if fn.__module__ == __name__}
    page = "Text.\n\n```python\nx = 1\n```\n<!-- snippet: compile needs 4 GPUs -->\n```python\n"
    page += (
        "y = (\n```\n\n```bash\nls\n```\n<!-- snippet: setup plain_loop -->\n```python\nz\n```\n"
    )
    page += "\n```text\n1\n 2\n```\n<!-- snippet: continue -->\n```python\nw\n```\n"
    page += "See:\n```text\n3\n```\n"
    got = [(s.line, s.code, s.marker, s.output) for s in parse(Path("page.md"), page)]
    assert got == [
        (3, "x = 1\n", None, None),
        (7, "y = (\n", ("compile", "needs 4 GPUs"), None),
        (15, "z\n", ("setup", "plain_loop"), "1\n 2\n"),
        (24, "w\n", ("continue", ""), None),  # prose between: no output block
    ]
    found = chains(parse(Path("page.md"), page))
    assert [c.id for c in found] == ["page:3", "page:7", "page:15+1"]
    assert found[2].setup == "plain_loop" and found[2].codes == ("z\n", "w\n")


def test_a_misplaced_marker_is_named():
    page = (
        "<!-- snippet: continue -->\n```python\nx\n```\n<!-- snippet: compile no -->\n```python\n"
    )
    page += "y\n```\n```text\n1\n```\n<!-- snippet: continue -->\n```python\nz\n```\n"
    page += "<!-- snippet: setup nowhere -->\n```python\nw\n```\n"
    assert problems(chains(parse(Path("page.md"), page)), SETUPS) == [
        "page:2: 'continue' needs a runnable snippet before it on its page",
        "page:6: a compile-only snippet has no output block to check",
        "page:13: 'continue' needs a runnable snippet before it on its page",
        "page:17: no setup named 'nowhere'",
    ]


def test_copies_of_a_snippet_run_once():
    """A snippet that is the start of another page's run under the same setup joins its group;
    each copy's output blocks are compared with that one run."""
    a = chains(parse(Path("a.md"), "```python\nprint(1)\n```\n```text\n1\n```\n"))
    b = chains(
        parse(
            Path("b.md"),
            "```python\nprint(1)\n```\n```text\n2\n```\n<!-- snippet: continue -->\n```python\n"
            "print(3)\n```\n```text\n3\n```\n",
        )
    )
    (g,) = groups(a + b)
    assert g.run is b[0] and g.id == "a:1=b:1+1"
    assert mismatches(g, ["1\n", "3\n"]) == [
        "b:1: the output block is not what the snippet prints\n"
        "--- output block\n+++ printed\n@@ -1 +1 @@\n-2\n+1"
    ]


def test_what_a_snippet_prints_is_compared(tmp_path, monkeypatch):
    """The printed lines are compared as text with the block; a snippet run as it is that
    prints shows its output."""
    monkeypatch.chdir(tmp_path)
    page = (
        "```python\nprint(f'{2 / 3:.3f}')\n```\n\n```text\n0.667\n```\n```python\nprint(1)\n```\n"
    )
    first, second = (Group(c, [c]) for c in chains(parse(Path("page.md"), page)))
    assert run(first.run, monkeypatch) == ["0.667\n"]
    assert mismatches(first, ["0.667\n"]) == []
    assert mismatches(first, ["0.6667\n"])
    assert mismatches(second, ["1\n"]) == ["page:8 prints, and shows no output block:\n1\n"]


def test_off_the_reference_platform_the_figures_are_not_compared(tmp_path, monkeypatch):
    """Elsewhere the snippet runs and its figures are not compared, which the skip says; a
    snippet that prints and shows nothing still fails."""
    import snippets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(snippets, "off_reference", lambda: "AVX2 kernels")
    page = "```python\nprint(0.5)\n```\n```text\n0.4\n```\n```python\nprint(1)\n```\n"
    wrong, silent = (Group(c, [c]) for c in chains(parse(Path("page.md"), page)))
    with pytest.raises(pytest.skip.Exception, match="here AVX2 kernels"):
        check(wrong, monkeypatch)
    with pytest.raises(AssertionError, match="shows no output block"):
        check(silent, monkeypatch)


def test_a_failing_snippet_fails(tmp_path, monkeypatch):
    """What the harness runs is the snippet: an error in it reaches the test."""
    (broken,) = chains(
        parse(Path("page.md"), "```python\nraise ValueError('in the snippet')\n```\n")
    )
    with pytest.raises(ValueError, match="in the snippet"):
        test_guide_snippet(Group(broken, [broken]), tmp_path, monkeypatch)


@pytest.mark.parametrize("group", GROUPS, ids=[g.id for g in GROUPS])
def test_guide_snippet(group, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check(group, monkeypatch)


# --- the setups -----------------------------------------------------------------------------


@snippet_setup
def plain_loop(ns, mp):
    """training-loop.md: a model, its audit loaders, 400 training batches."""
    from torch.utils.data import DataLoader, TensorDataset

    x, y = digits()
    model = mlp()
    batches = [(x[i : i + 32], y[i : i + 32]) for i in torch.randint(0, 68, (400,)).tolist()]
    ns.update(
        model=model,
        member_loader=DataLoader(TensorDataset(x[:100], y[:100]), batch_size=100),
        heldout_loader=DataLoader(TensorDataset(x[100:], y[100:]), batch_size=300),
        privacy_engine=None,
        total_steps=len(batches),
        train_loader=batches,
        loss_fn=torch.nn.functional.cross_entropy,
        opt=torch.optim.Adam(model.parameters(), lr=1e-3),
    )
    yield
    checked(ns["monitor"], checks=2)


@snippet_setup
def traced_loop(ns, mp):
    """training-loop.md: a model, its audit loaders, 200 training batches yielding indices."""
    from torch.utils.data import DataLoader, TensorDataset

    x, y = digits()
    model = mlp()
    train_set = TensorDataset(torch.arange(100), x[:100], y[:100])
    ns.update(
        torch=torch,
        model=model,
        train_set=train_set,
        member_loader=DataLoader(TensorDataset(x[:100], y[:100]), batch_size=100),
        heldout_loader=DataLoader(TensorDataset(x[100:], y[100:]), batch_size=300),
        train_loader=[b for _ in range(10) for b in DataLoader(train_set, batch_size=5)],
        opt=torch.optim.Adam(model.parameters(), lr=1e-3),
    )
    yield
    checked(ns["monitor"], checks=2)
    assert ns["monitor"].loss_traces.loop.steps == 201


@snippet_setup
def mlflow_run(ns, mp):
    """training-loop.md: a query and audit sets; MLflow's store in the working directory."""
    pytest.importorskip("mlflow")
    from privmon.queries import LossQuery

    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mp.setenv("MLFLOW_TRACKING_URI", Path("mlruns").resolve().as_uri())
    x, y = digits(200)
    ns.update(query=LossQuery(mlp()), members=[(x[:100], y[:100])], heldout=[(x[100:], y[100:])])
    yield
    monitor = ns["monitor"]
    assert monitor.check(1) is not None
    monitor.close()
    assert Path("runs/exp1/checks.jsonl").read_text(encoding="utf-8").count("\n") == 1


@snippet_setup
def wandb_run(ns, mp):
    """training-loop.md: a query and audit sets; W&B offline in the working directory (no
    server, no key)."""
    wandb = pytest.importorskip("wandb")
    # W&B as a new process has it: an earlier test's run (the WandbSink doctest's) can leave its
    # settings behind, WANDB_DIR included, and this run's file would go there (wandb 0.19)
    wandb.teardown()
    from privmon.queries import LossQuery

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(Path.cwd()),
                        "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():  # fmt: skip
        mp.setenv(name, value)
    mp.delenv("WANDB_API_KEY", raising=False)
    x, y = digits(200)
    ns.update(query=LossQuery(mlp()), members=[(x[:100], y[:100])], heldout=[(x[100:], y[100:])])
    yield
    assert list(Path("wandb").glob("offline-run-*/run-*.wandb"))


@snippet_setup
def diffusion_loop(ns, mp):
    """diffusion.md: a tiny random-weight UNet and its DDPM scheduler, 8×8 member and held-out
    images, one training batch (step 0 is a check)."""
    diffusers = pytest.importorskip("diffusers")
    images = torch.randn(48, 1, 8, 8)
    ns.update(
        unet=tiny_unet(),
        noise_scheduler=diffusers.DDPMScheduler(num_train_timesteps=1000),
        member_batches=[images[:16]],
        heldout_batches=[images[16:]],
        train_dataloader=[images[:16]],
    )
    yield
    checked(ns["monitor"], checks=1)


@snippet_setup
def hf_trainer(ns, mp):
    """transformers.md: a tiny causal LM, its audit batches and a training set of 51 steps."""
    transformers = pytest.importorskip("transformers")
    tokenizer, model, texts = tiny_lm()
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    encoded = [tokenizer(t, padding="max_length", max_length=16, truncation=True) for t in texts]
    ns.update(
        model=model,
        member_batches=[collator(encoded[i : i + 32]) for i in range(0, 64, 32)],
        heldout_batches=[collator(encoded[i : i + 32]) for i in range(200, 264, 32)],
        train_dataset=[{**e, "labels": e["input_ids"]} for e in encoded[:136]],
    )
    yield
    checked(ns["monitor"], checks=1)
    assert ns["trainer"].state.global_step == 51


@snippet_setup
def lm_trainer(ns, mp):
    """language-models.md: a tiny causal LM and its base model, texts, Trainer arguments."""
    transformers = pytest.importorskip("transformers")
    tokenizer, model, texts = tiny_lm()
    base = type(model)(model.config)
    base.load_state_dict(model.state_dict())
    ns.update(
        transformers=transformers,
        tokenizer=tokenizer,
        model=model,
        base_model=base.eval(),
        encode=lambda batch: [tokenizer(t) for t in batch],
        train_texts=texts[:256],
        heldout_texts=texts[256:512],
        train_dataset=[tokenizer(t) for t in texts[:256]],
        args=transformers.TrainingArguments(
            output_dir="out", max_steps=100, report_to="none", save_strategy="no"
        ),
    )
    yield
    checked(ns["monitor"], checks=1)
    assert set(ns["monitor"].last_report.queries) == {
        "loss",
        "zlib",
        "min_k",
        "min_k_plus_plus",
        "reference",
    }


@snippet_setup
def lm_canaries(ns, mp):
    """language-models.md: a tiny causal LM, its tokenizer and training texts."""
    pytest.importorskip("transformers")
    tokenizer, model, texts = tiny_lm()
    ns.update(tokenizer=tokenizer, model=model, train_texts=list(texts[:50]))
    yield
    assert len(ns["train_texts"]) == 70


@snippet_setup
def lightning_loaders(ns, mp):
    """lightning.md: audit loaders and a training loader of one batch per epoch."""
    pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    x, y = digits()
    ns.update(
        member_loader=DataLoader(TensorDataset(x[:100], y[:100]), batch_size=100),
        heldout_loader=DataLoader(TensorDataset(x[100:], y[100:]), batch_size=300),
        train_loader=DataLoader(TensorDataset(x[:100], y[:100]), batch_size=100, shuffle=True),
    )
    yield
    assert ns["monitor"].n_failed == 0 and ns["monitor"].history


@snippet_setup
def ignite_trainer(ns, mp):
    """ignite.md: an Ignite trainer of a model, its audit loaders, 5 batches per epoch."""
    pytest.importorskip("ignite")
    from ignite.engine import Engine
    from torch.utils.data import DataLoader, TensorDataset

    x, y = digits()
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def update(engine, batch):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss.item()

    ns.update(
        model=model,
        trainer=Engine(update),
        member_loader=DataLoader(TensorDataset(x[:100], y[:100]), batch_size=100),
        heldout_loader=DataLoader(TensorDataset(x[100:], y[100:]), batch_size=300),
        train_loader=DataLoader(TensorDataset(x[:100], y[:100]), batch_size=20),
    )
    yield
    checked(ns["monitor"], checks=1)


@snippet_setup
def distributed_loop(ns, mp):
    """distributed.md: a one-process gloo group, a model, its audit batches."""
    import torch.distributed as dist

    from privmon.queries import LossQuery

    x, y = digits()
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(Path("store").resolve()), 1), rank=0, world_size=1
    )
    try:
        ns.update(
            dist=dist,
            LossQuery=LossQuery,
            model=mlp(),
            member_batches=[(x[i : i + 50], y[i : i + 50]) for i in range(0, 100, 50)],
            heldout_batches=[(x[i : i + 50], y[i : i + 50]) for i in range(100, 400, 50)],
            total_steps=200,
        )
        yield
        checked(ns["monitor"], checks=1)
    finally:
        dist.destroy_process_group()


@snippet_setup
def dp_sgd(ns, mp):
    """dp-audit.md: a model, optimizer and loader before make_private; 100 steps' batches."""
    pytest.importorskip("opacus")
    ns.update(dp_model())
    ns["batches"] = [ns["members"][0]] * 50
    yield
    checked(ns["monitor"], checks=1)
    assert "privacy/canaries/steinke/epsilon_lower_bound" in ns["monitor"].last_report.scalars


@snippet_setup
def dp_optimizer(ns, mp):
    """dp-audit.md: the engine and the DP optimizer of the snippet above."""
    from privmon.audit import GradientCanaries, MechanismChecks

    parts = dp_private()
    engine, optimizer = parts["engine"], parts["optimizer"]
    ns.update(engine=engine, optimizer=optimizer, GradientCanaries=GradientCanaries)
    yield
    assert isinstance(ns["canaries"], GradientCanaries)
    ns["canaries"].detach()
    MechanismChecks(optimizer).detach()  # the comment's alternative, once the canaries are gone


@snippet_setup
def record_canaries(ns, mp):
    """dp-audit.md: training records, a model, its query, audit sets, an engine, q and lr."""
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader

    from privmon.queries import LossQuery

    parts = dp_model()
    train = parts["loader"].dataset
    ns.update(
        torch=torch,
        DataLoader=DataLoader,
        train=train,
        model=parts["model"],
        query=LossQuery(parts["model"]),
        members=parts["members"],
        nonmembers=parts["nonmembers"],
        engine=PrivacyEngine(),
        N=len(train),
        q=0.1,
        lr=0.1,
    )
    yield
    report = ns["monitor"].check(1)
    assert report is not None and "privacy/canaries/fdp/epsilon_lower_bound" in report.scalars


@snippet_setup
def scores(ns, mp):
    """offline-audits.md: members' and non-members' scores, and records to score."""
    rng = np.random.default_rng(0)
    member, nonmember = rng.normal(0.5, 1, 300), rng.normal(0, 1, 300)
    ns.update(member_scores=member, nonmember_scores=nonmember, m=member, n=nonmember)
    ns["scores"] = rng.normal(0, 1, 10)
    yield


@snippet_setup
def softmax_outputs(ns, mp):
    """queries.md: softmax outputs of 800 records and their labels."""
    rng = np.random.default_rng(0)
    ns["y"] = rng.integers(0, 10, 800)
    logits = rng.normal(0, 1, (800, 10))
    logits[np.arange(800), ns["y"]] += 2
    ns["probs"] = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    yield


@snippet_setup
def reference_models(ns, mp):
    """reference-models.md: a model, 4 reference models, an Ensemble of 8, reference and
    population records."""
    import privmon

    x, y = digits()
    masks = privmon.audit.random_halves(200, 8, seed=0)
    ensemble = privmon.audit.train_ensemble(
        mlp,
        (x[:200], y[:200]),
        masks,
        loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        epochs=2,
        batch_size=50,
        seed=0,
    )
    ns.update(
        model=mlp(),
        references=[mlp() for _ in range(4)],
        ensemble=ensemble,
        x_ref=x[:200],
        y_ref=y[:200],
        x_z=x[300:400],
        y_z=y[300:400],
    )
    yield


@snippet_setup
def specific_setup(ns, mp):
    """reference-models.md: a train_fn (a few steps of softmax regression), a dataset, targets,
    reference records and a pool."""

    x, y = digits()

    def train_fn(xs, ys, seed):
        model = torch.nn.Linear(64, 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(10):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
        return model

    ns.update(
        train_fn=train_fn,
        x=x[:100],
        y=y[:100],
        targets=list(range(10)),
        xr=x[100:200],
        yr=y[100:200],
        pool=(x[:300], y[:300]),
    )
    yield
    assert ns["res"].auc.shape == (10,)


@snippet_setup
def synthetic_set(ns, mp):
    """synthetic-data.md: a synthetic set, a reference set, test records and their membership."""

    rng = np.random.default_rng(0)
    train = rng.normal(0, 1, (100, 2))
    ns.update(
        test=np.concatenate([train, rng.normal(0, 1, (100, 2))]),
        synthetic=train[rng.integers(0, 100, 500)] + rng.normal(0, 0.1, (500, 2)),
        reference=rng.normal(0, 1, (500, 2)),
        is_member=np.arange(200) < 100,
    )
    yield


@snippet_setup
def census(ns, mp):
    """synthetic-tables.md: the census splits, SynthesizerQuery, attach and a TVAE whose fits
    are cut to 200 epochs (the page's 2,000 would take a minute)."""
    import ctgan

    from privmon.integrations.synthesizers import attach
    from privmon.queries import SynthesizerQuery

    census_splits(ns)

    class TVAE(ctgan.TVAE):
        def __init__(self, epochs=300, **kwargs):
            super().__init__(epochs=min(epochs, 200), **kwargs)

    ns.update(SynthesizerQuery=SynthesizerQuery, attach=attach, TVAE=TVAE)
    yield
    assert len(ns["monitor"].history.steps) >= 1  # the fit was watched


@snippet_setup
def synthetic_table(ns, mp):
    """synthetic-tables.md: a released table that copies its members with noise on wage."""
    census_splits(ns)
    members, heldout = ns["members"], ns["heldout"]
    synthetic = members.sample(1000, replace=True, random_state=0).reset_index(drop=True)
    synthetic["wage"] *= np.exp(np.random.default_rng(0).normal(0, 0.05, len(synthetic)))
    ns["heldout"] = heldout = ns["reference"][:1000]  # the page's 1,000 held-out records
    ns["reference"] = ns["reference"][1000:]
    ns.update(
        test=members._append(heldout, ignore_index=True),
        synthetic=synthetic,
        is_member=np.arange(len(members) + len(heldout)) < len(members),
    )
    yield


# --- figures the guide states ---------------------------------------------------------------


def test_a_plan_loosens_the_first_checks_and_tightens_the_later_ones():
    """training-loop.md's figures: at the README quickstart's audit sizes (100 + 1,000 records,
    20 checks), the detectable advantage unplanned vs planned, check by check."""
    from torch.utils.data import DataLoader, TensorDataset

    import privmon
    from privmon.queries import LossQuery

    x, y = torch.zeros(1100, 64), torch.zeros(1100, dtype=torch.long)

    def monitor(**kw: Any) -> privmon.PrivacyMonitor:
        return privmon.PrivacyMonitor(
            LossQuery(torch.nn.Linear(64, 10)),
            DataLoader(TensorDataset(x[:100], y[:100]), batch_size=250),
            DataLoader(TensorDataset(x[100:], y[100:]), batch_size=250),
            every_n_steps=100,
            **kw,
        )

    unplanned, planned = monitor(), monitor(planned_checks=20)
    u = [unplanned.detectable_advantage(check=k) for k in range(1, 21)]
    p = [planned.detectable_advantage(check=k) for k in range(1, 21)]
    assert all(a < b for a, b in zip(u[:3], p[:3], strict=True))
    assert all(a > b for a, b in zip(u[3:], p[3:], strict=True))
    stated = {1: (0.214, 0.267), 3: (0.261, 0.267), 4: (0.271, 0.267), 20: (0.320, 0.267)}
    for k, (a, b) in stated.items():
        assert (round(u[k - 1], 3), round(p[k - 1], 3)) == (a, b), k
