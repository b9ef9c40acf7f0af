"""Every Python snippet of the README (and of the docs' home page, which repeats its quickstart)
runs, and prints what its output block says.

The conventions and the harness: ``tests/snippets.py``. The quickstarts run as they are, in full;
the other README snippets take the names they use from a setup here. A snippet that is also on a
guide page (the GAN quickstart is) runs there: here its output blocks are compared with the
guide's, which ``test_guide_snippets.py`` compares with what it prints.
"""

from __future__ import annotations

import pytest
from snippets import (
    ROOT,
    SETUPS,
    census_splits,
    check,
    checked,
    dp_private,
    groups,
    mismatches,
    pages,
    problems,
    snippet_setup,
    tiny_lm,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

README, HOME = ROOT / "README.md", ROOT / "docs" / "index.md"
CHAINS = pages(README, HOME)
GROUPS = groups(CHAINS)
GUIDE = pages(*sorted((ROOT / "docs" / "guide").glob("*.md")))


def test_the_readme_has_snippets_and_each_marker_is_known():
    assert sum(len(c.snippets) for c in CHAINS if c.head.path == README) >= 6
    assert not problems(CHAINS, SETUPS)
    used = {c.setup for c in CHAINS} - {None}
    assert used == {name for name, fn in SETUPS.items() if fn.__module__ == __name__}


def test_the_quickstarts_show_what_they_print():
    """Both quickstarts run as they are and have their output blocks (the figures the README
    states are these)."""
    quickstarts = [c for c in CHAINS if c.head.path == README and c.setup is None]
    assert len(quickstarts) == 2
    assert all(s.output for c in quickstarts for s in c.snippets)


@pytest.mark.parametrize("group", GROUPS, ids=[g.id for g in GROUPS])
def test_readme_snippet(group, tmp_path, monkeypatch):
    twin = next((c for c in GUIDE if group.run.runs_as(c)), None)
    if twin is not None and all(s.output is not None for s in twin.snippets):
        # the guide's test runs it and checks the guide's blocks: these must be the same
        wrong = mismatches(group, [s.output for s in twin.snippets])
        assert not wrong, f"{twin.id} prints what its blocks say:\n" + "\n\n".join(wrong)
        return
    monkeypatch.chdir(tmp_path)
    check(group, monkeypatch)


# --- the setups -----------------------------------------------------------------------------


@snippet_setup
def readme_tvae(ns, mp):
    """README, synthetic tables: a TVAE of 100 epochs (a check at its end), the census splits."""
    import ctgan

    census_splits(ns)
    ns["tvae"] = ctgan.TVAE(epochs=100, enable_gpu=False)
    yield
    checked(ns["monitor"], checks=1)


@snippet_setup
def readme_lm(ns, mp):
    """README, language models: a tiny causal LM, its base model, audit batches and a Trainer of
    100 steps, trained after the snippet (one check, at step 100)."""
    transformers = pytest.importorskip("transformers")
    tokenizer, model, texts = tiny_lm()
    base = type(model)(model.config)
    base.load_state_dict(model.state_dict())
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    encoded = [tokenizer(t) for t in texts]
    args = transformers.TrainingArguments(
        output_dir="out", max_steps=100, report_to="none", save_strategy="no"
    )
    ns.update(
        model=model,
        tokenizer=tokenizer,
        base_model=base.eval(),
        members=[collator(encoded[i : i + 32]) for i in range(0, 64, 32)],
        nonmembers=[collator(encoded[i : i + 32]) for i in range(300, 364, 32)],
        trainer=transformers.Trainer(
            model=model, args=args, train_dataset=encoded[:256], data_collator=collator
        ),
    )
    yield
    ns["trainer"].train()
    logged = {k for entry in ns["trainer"].state.log_history for k in entry}
    assert {"privacy/loss/auc", "privacy/min_k_plus_plus/auc"} <= logged


@snippet_setup
def readme_canaries(ns, mp):
    """README, one-run DP audit: the engine and DP optimizer after make_private, a loss query of
    the private model and audit sets; one check after the snippet."""
    from privmon.queries import LossQuery

    parts = dp_private()
    ns.update(
        engine=parts["engine"],
        optimizer=parts["optimizer"],
        query=LossQuery(parts["model"]),
        members=parts["members"],
        nonmembers=parts["nonmembers"],
    )
    yield
    report = ns["monitor"].check(1)
    assert report is not None
    assert "privacy/canaries/steinke/epsilon_lower_bound" in report.scalars
    ns["canaries"].detach()
