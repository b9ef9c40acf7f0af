"""No part of a record's value appears in an error, a log line or a warning: every public entry
point is driven with records holding a planted secret (a string, a distinctive number) and with
bad input, every exception text (its whole chain), warning, log record (DEBUG and up) and printed
line is captured, and none may hold any trace of the secret. Messages say a type, a shape, a
count or an index, never a value."""

from __future__ import annotations

import logging
import re
import traceback
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import privmon
from privmon import attacks, audit, queries
from privmon.cli import main as cli
from privmon.integrations.lightning import PrivacyMonitorCallback
from privmon.sinks import JsonlSink

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SECRET_TEXT = "SSN-SECRET-078"
SECRET_NUMBER = 123456.789
SECRET_LABEL = 123456
# any rendering of the secrets: the string or a part of it, the number's digits in any format
TRACES = re.compile(r"SECRET|SSN-|12345[67]|1\.23[45]\d*e\+0?5")

N = 40


def _traced(text: str) -> bool:
    return TRACES.search(text) is not None


def test_the_scan_finds_every_rendering_of_the_secrets():
    # the detector is not vacuous: the ways a message used to show a record all trip it
    record = pd.DataFrame({"id": [SECRET_TEXT], "wage": [SECRET_NUMBER]})
    shown = [repr(record), f"{SECRET_TEXT!r:.40}", str(torch.tensor([SECRET_NUMBER]))]
    shown += [f"{SECRET_NUMBER:{spec}}" for spec in ("", ".4g", ".5g", "g", "e", ".3f", ".0f")]
    shown += [str(np.float32(SECRET_NUMBER)), str(SECRET_LABEL), repr(np.array([SECRET_NUMBER]))]
    assert all(_traced(text) for text in shown)
    assert not _traced("labels must lie in [0, 1] for 2 classes; 1 of 40 (the first at index 7)")


def _features():
    """(N, 4) records, one of them holding the secret number."""
    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[7, 1] = SECRET_NUMBER
    return x


def _table(n=N, secret=True, seed=0):
    """A mixed-type table; with ``secret`` one record holds the secret string and number."""
    rng = np.random.default_rng(seed)
    table = pd.DataFrame(
        {"wage": rng.normal(size=n), "region": rng.choice(["north", "south"], size=n)}
    )
    if secret:
        table.loc[3, "wage"] = SECRET_NUMBER
        table.loc[5, "region"] = SECRET_TEXT
    return table


TEXTS = [f"patient {SECRET_TEXT} admitted with {SECRET_NUMBER}", "another record"]


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2).double()

    def forward(self, x):
        return self.net(x)


class _Synthesizer:
    """Samples the secret-holding table: no synthesizer privmon knows."""

    def sample(self, n):
        return _table(n)


def _labels(secret=False):
    y = torch.zeros(N, dtype=torch.long)
    y[::2] = 1
    if secret:
        y[7] = SECRET_LABEL
    return y


def _probs(secret=True):
    p = torch.full((N, 2), 0.5, dtype=torch.float64)
    if secret:
        p[7, 0] = SECRET_NUMBER
    return p


def _monitor_on(members, nonmembers, query=None, **kwargs):
    query = query if query is not None else queries.LossQuery(_Classifier())
    return privmon.PrivacyMonitor(query, members, nonmembers, every_n_steps=1, **kwargs)


def _heldout():
    return torch.randn(N, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _check(members, nonmembers, query=None, **kwargs):
    """One check of a monitor (logged when it fails), then the monitor closed."""
    monitor = _monitor_on(members, nonmembers, query, **kwargs)
    try:
        monitor.check(1)
    finally:
        monitor.close()


def _sampled_table_scores():
    """DOMIAS scores of a generator that samples the secret-holding table."""
    query = queries.GeneratorQuery(
        None, _table(secret=False), sample_fn=lambda n, device: _table(n), n_samples=N
    )
    query.prepare()
    try:
        return query(_table(secret=False, seed=4))
    finally:
        query.release()


def _score_file(path: Path) -> str:
    path.write_text(f"score\n0.5\n{SECRET_TEXT}\n", encoding="utf-8")
    return str(path)


def _conditioning():
    """Class embeddings, the first one the secret number."""
    c = torch.zeros(3, 4)
    c[0, 0] = SECRET_NUMBER
    return c


def _diffusion_images():
    images = torch.rand(3, 1, 4, 4)
    images[0, 0, 0, 0] = SECRET_NUMBER
    return images


ABAR = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100, dtype=torch.float64), dim=0)

# (name, call(tmp_path)): each emits at least one message (an error, a warning or a log line)
CASES = [
    # the audit sets: a text, a table, a mapping, a tensor passed as the set itself
    ("a text as the member set",
     lambda tmp: _monitor_on(" ".join(TEXTS), [(_features(), _labels())])),
    ("a table as the member set", lambda tmp: _monitor_on(_table(), [(_features(), _labels())])),
    ("a mapping as the non-member set",
     lambda tmp: _monitor_on([(_features(), _labels())], {"x": _features(), "id": TEXTS})),
    ("a tensor as the member set", lambda tmp: _monitor_on(_features(), [_features()])),
    ("bytes as the member set", lambda tmp: _monitor_on(SECRET_TEXT.encode(), [_features()])),
    # records where an object or an option is expected (a mixed-up argument)
    ("records as the query",
     lambda tmp: _monitor_on([_features()], [_heldout()], query=_features())),
    ("a table as a sink", lambda tmp: _monitor_on(
        [_features()], [_heldout()], query=queries.CallableQuery(lambda b: b[:, 0], name="q"),
        sinks=[_table()])),
    ("records as the monitor of a Lightning callback",
     lambda tmp: PrivacyMonitorCallback(_features())),
    ("records as the metric watched", lambda tmp: privmon.PrivacyEarlyStopping(_features(), 0.1)),
    ("records as an attack's metric", lambda tmp: privmon.MetricAttack(_probs())),
    ("a table as a statistic", lambda tmp: queries.DiffusionQuery(lambda x, t: x, ABAR, _table())),
    ("records as a flag", lambda tmp: privmon.PrivacyRiskScore(class_conditional=_features())),
    ("a record as the step", lambda tmp: _monitor_on(
        [_features()], [_heldout()], query=lambda b: b[:, 0]).step(_features()[7, 1])),
    # the functional core on scores that are records
    ("strings as scores", lambda tmp: privmon.optimal_advantage([SECRET_TEXT, 1.0], [0.0, 1.0])),
    ("a table as scores", lambda tmp: privmon.optimal_advantage(_table(), _table(seed=1))),
    ("records as a canary block's query",
     lambda tmp: audit.InputCanaries(list(range(8)), query=_features())),
    ("a table as a synthesizer", lambda tmp: queries.SynthesizerQuery(_table(), _table())),
    ("3-D scores", lambda tmp: privmon.optimal_advantage(_features()[:, :, None], _features())),
    ("texts as queries", lambda tmp: privmon.individual_risk(TEXTS, _features()[:, 1], [0.0])),
    ("a mapping as scores", lambda tmp: privmon.analyse(_features()[:, 1], {"id": SECRET_TEXT})),
    ("strings beside numbers",
     lambda tmp: privmon.auc(np.array([SECRET_NUMBER, 1.0]), [SECRET_TEXT, "x"])),
    ("records as an advantage", lambda tmp: privmon.epsilon_lower_bound(_features()[:, 1])),
    ("records as an epsilon", lambda tmp: privmon.tanh_bound(-_features()[:, 1])),
    ("records as quantiles", lambda tmp: attacks.subgroup_risk(
        [0.1, 0.2], [0.3, 0.1], ["a", "b"], ["a", "b"], q=[SECRET_NUMBER, SECRET_TEXT])),
    ("records as a prior", lambda tmp: privmon.optimal_advantage(
        [0.1, 0.2], [0.3, 0.1], prior=np.array([SECRET_NUMBER]))),
    ("texts into a streaming state",
     lambda tmp: privmon.StreamingAdvantage().update(TEXTS, _features()[:2, 1])),
    ("group labels of two kinds", lambda tmp: attacks.subgroup_risk(
        _features()[:, 1], _features()[:, 2], [SECRET_TEXT] * N, [SECRET_LABEL] * N)),
    ("scores in a one-run audit",
     lambda tmp: audit.one_run_epsilon([SECRET_TEXT], [SECRET_NUMBER], delta=1e-5)),
    ("risks of two setups", lambda tmp: audit.compare([SECRET_NUMBER, 0.5], [SECRET_TEXT, 0.4])),
    # attacks on model outputs that hold the secret
    ("probabilities out of [0, 1]", lambda tmp: privmon.MetricAttack("confidence").fit(
        _probs(), _labels(), _probs(secret=False), _labels())),
    ("a label out of range", lambda tmp: privmon.MetricAttack("confidence").fit(
        _probs(secret=False), _labels(secret=True), _probs(secret=False), _labels())),
    ("risk scores out of [0, 1]",
     lambda tmp: attacks.calibration(_features()[:, 1], np.ones(N, dtype=bool))),
    ("RMIA probabilities out of [0, 1]", lambda tmp: attacks.rmia(
        _probs()[:, 0], _probs()[:, 0].repeat(4, 1), np.ones((4, N), dtype=bool),
        population=np.ones(N, dtype=bool))),
    ("token ids out of the vocabulary", lambda tmp: attacks.token_log_probs(
        torch.zeros(1, 3, 5), torch.tensor([[1, SECRET_LABEL]]), torch.ones(1, 2, dtype=bool))),
    # tables: categories, numbers, columns
    ("an unknown category", lambda tmp: attacks.TableEncoder(
        _table(secret=False), unknown="error").encode(_table(), name="test")),
    ("an unknown category encoded as other", lambda tmp: attacks.TableEncoder(
        _table(secret=False), unknown="other").encode(_table(), name="test")),
    ("text in a numeric column", lambda tmp: attacks.TableEncoder(_table(secret=False)).encode(
        _table(secret=False).assign(wage=[SECRET_TEXT] * N), name="test")),
    ("a table with one category in a column", lambda tmp: attacks.TableEncoder(
        _table(secret=False).assign(region=SECRET_TEXT)).encode(_table(), name="test")),
    ("DOMIAS on a table with an unknown category",
     lambda tmp: privmon.domias_scores(_table(), _table(secret=False, seed=1),
                                       _table(secret=False, seed=2))),
    ("DOMIAS on records of the wrong width",
     lambda tmp: privmon.domias_scores(_features(), _features()[:, :3], _features())),
    ("DCR against a table of other columns",
     lambda tmp: attacks.dcr(_table(), _table().rename(columns={"wage": "income"}))),
    ("an audit of a table with an unknown category",
     lambda tmp: audit.audit_synthetic(_table(seed=3), _table(), _table(secret=False, seed=1),
                                       _table(secret=False, seed=2))),
    # queries on batches that hold the secret
    ("a label out of the classes", lambda tmp: queries.LossQuery(_Classifier())(
        (_features(), _labels(secret=True)))),
    ("texts as a classifier's batch", lambda tmp: queries.LossQuery(_Classifier())(TEXTS)),
    ("a table as a classifier's batch", lambda tmp: queries.LossQuery(_Classifier())(_table())),
    ("conditioning that is no mapping", lambda tmp: attacks.diffusion_statistic(
        lambda x, t: x, _diffusion_images(), ABAR, statistic="sima", timesteps=[5],
        conditioning=_conditioning())),
    ("conditioning of the wrong length", lambda tmp: queries.DiffusionQuery(
        lambda x, t, **c: x, ABAR, "sima", timesteps=[5])(
            {"images": _diffusion_images(), "labels": _conditioning()[:2]})),
    ("an object that is no synthesizer",
     lambda tmp: queries.SynthesizerQuery(_Synthesizer(), _table(secret=False))),
    ("a generator query sampling a table with an unknown category",
     lambda tmp: _sampled_table_scores()),
    # the monitor: a check on records the query cannot score, on records it scores
    ("a check whose query fails on a record",
     lambda tmp: _check([(_features(), _labels(secret=True))], [(_heldout(), _labels())])),
    ("a check on scores that are the records",
     lambda tmp: _check([_features()], [_heldout()],
                        query=queries.CallableQuery(lambda b: b[:, 1], name="wage"),
                        sinks=[JsonlSink(tmp / "checks.jsonl")], writer=str(tmp / "tb"))),
    ("a check on strings", lambda tmp: _check(
        [_features()], [_heldout()], query=queries.CallableQuery(lambda b: TEXTS, name="q"))),
    # the command line on a score file that holds a record
    ("a score file with a record in it",
     lambda tmp: cli(["audit", _score_file(tmp / "m.csv"), _score_file(tmp / "n.csv")])),
]  # fmt: skip


def _chain(err: BaseException | None) -> list[str]:
    """The text of an exception and of every exception a traceback shows with it (the one it
    was raised from, or during unless ``raise ... from None`` hid that)."""
    out: list[str] = []
    while err is not None and len(out) < 100:
        out += [str(err), *map(repr, err.args), *traceback.format_exception_only(err)]
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return out


@pytest.mark.parametrize(("name", "call"), CASES, ids=[c[0] for c in CASES])
def test_no_message_shows_a_record(name, call, tmp_path, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call(tmp_path)
        except SystemExit:
            pass
        except Exception as err:
            texts += _chain(err)
    texts += [str(w.message) for w in caught]
    for record in caplog.records:
        texts.append(record.getMessage())
        if record.exc_info:
            texts += _chain(record.exc_info[1])
    printed = capsys.readouterr()
    texts += [printed.out, printed.err]
    assert any(t.strip() for t in texts), f"{name}: no message to scan"
    leaked = [t for t in texts if _traced(t)]
    assert not leaked, f"{name}: {leaked}"
    for path in tmp_path.rglob("*"):  # what the sinks wrote: indices and figures only
        if path.is_file() and path.suffix != ".csv":  # (the CLI case's own input files)
            assert not _traced(path.read_bytes().decode("latin-1")), path


def test_no_message_formats_a_truncated_repr():
    # the pattern of the leak: {value!r:.40} shows the first characters of whatever was passed
    sources = Path(privmon.__file__).parent.rglob("*.py")
    found = [f"{p.name}:{i}" for p in sources
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"!r:\.\d", line)]  # fmt: skip
    assert found == []


def test_configuration_is_still_shown_as_written():
    # hiding records must not hide the typo a user needs to see
    with pytest.raises(ValueError, match=r"got 'histgram'"):
        privmon.optimal_advantage([0.1, 0.2], [0.3, 0.4], method="histgram")
    with pytest.raises(ValueError, match=r"got 1\.5$"):
        privmon.optimal_advantage([0.1, 0.2], [0.3, 0.4], delta=1.5)
    with pytest.raises(ValueError, match=r"got str '1e-5'"):
        privmon.optimal_advantage([0.1, 0.2], [0.3, 0.4], delta="1e-5")
    with pytest.raises(ValueError, match=r"got \('histogram', 'kde2'\)"):
        privmon.analyse([0.1, 0.2], [0.3, 0.4], methods=("histogram", "kde2"))
    text = "histogram, as the paper does"  # a text, not an option's name
    with pytest.raises(ValueError, match=rf"got a str of {len(text)} characters$"):
        privmon.optimal_advantage([0.1, 0.2], [0.3, 0.4], method=text)
