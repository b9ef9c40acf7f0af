"""TensorBoard output of a real PrivacyMonitor: event files read back with TensorBoard's own
EventAccumulator (scalars, member-risk histograms, PR curves, the run id of every check, the
custom-scalar layout, the first charts' named series, each a run of its own), a run with a real
Opacus accountant, and a real ``tensorboard`` server queried over HTTP (each chart's series
exactly, one run each, and the ε chart's y-range under the dashboard's outlier clipping)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import RecordingSink, traced_run
from opacus.accountants import RDPAccountant
from sklearn.datasets import load_breast_cancer
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util
from torch import nn

import privmon
from privmon import PrivacyMonitor
from privmon.queries import LossQuery
from privmon.report import tags
from privmon.report.tags import RUN_ID_EVENT_TAG

CHECK_STEPS = [2, 4, 6]
N_MEM = N_NON = 100
DELTA = 1e-5
SIGMA, RATE = 1.0, 0.01
CORE_TAGS = [
    "privacy/loss/histogram/value",
    "privacy/loss/histogram/lower",
    "privacy/loss/histogram/plugin",
    "privacy/loss/histogram/plugin_upper",
    "privacy/loss/kde/value",
    "privacy/loss/kde/lower",
    "privacy/loss/kde/plugin",
    "privacy/loss/kde/plugin_upper",
    "privacy/loss/auc",
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(logdir, accountant=None):
    """Train a small classifier on the breast-cancer data for 6 steps, a check every 2."""
    x, y = load_breast_cancer(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    x, y = torch.from_numpy(x), torch.from_numpy(y).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 16), nn.ReLU(), nn.Linear(16, 2))
    members = [(x[i : i + 50], y[i : i + 50]) for i in range(0, N_MEM, 50)]
    nonmembers = [(x[i : i + 50], y[i : i + 50]) for i in range(300, 300 + N_NON, 50)]
    keep = RecordingSink()
    monitor = PrivacyMonitor(
        LossQuery(model),
        members,
        nonmembers,
        methods=("histogram", "kde"),
        writer=str(logdir),
        sinks=[keep],
        every_n_steps=2,
        accountant=accountant,
        delta=DELTA,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    epsilons = []  # ε at each check, from an independent accountant stepped alongside
    shadow = RDPAccountant()
    for _ in range(3):
        shadow.step(noise_multiplier=SIGMA, sample_rate=RATE)
    for step in range(1, 7):
        for xb, yb in members:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        if accountant is not None:
            accountant.step(noise_multiplier=SIGMA, sample_rate=RATE)
            shadow.step(noise_multiplier=SIGMA, sample_rate=RATE)
        if step in CHECK_STEPS:
            epsilons.append(shadow.get_epsilon(DELTA))
        monitor.step(step)
    monitor.close()
    return monitor, keep.reports, epsilons


def _accumulator(logdir):
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    )
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tb")


@pytest.fixture(scope="module")
def plain(root):
    monitor, reports, _ = _run(root / "plain")
    return monitor, reports, _accumulator(root / "plain")


@pytest.fixture(scope="module")
def dp(root):
    accountant = RDPAccountant()
    for _ in range(3):
        accountant.step(noise_multiplier=SIGMA, sample_rate=RATE)
    monitor, reports, epsilons = _run(root / "dp", accountant=accountant)
    return monitor, reports, _accumulator(root / "dp"), epsilons, accountant


def _f32(v):
    return np.float32(v)


def _same32(a, b):
    a, b = _f32(a), _f32(b)
    return (np.isnan(a) and np.isnan(b)) or a == b


def _layout(acc):
    events = acc.Tensors("custom_scalars__config__")
    assert len(events) == 1  # written once, at the first check
    layout = layout_pb2.Layout()
    layout.ParseFromString(events[0].tensor_proto.string_val[0])
    return {  # a multiline chart's regular expressions; a margin chart's (value, lower, upper)
        (cat.title, chart.title): (
            list(chart.multiline.tag)
            if chart.HasField("multiline")
            else [(m.value, m.lower, m.upper) for m in chart.margin.series]
        )
        for cat in layout.category
        for chart in cat.chart
    }


def _series_runs(logdir):
    """{named series: EventAccumulator} of the first charts' runs, the folders in ``logdir``."""
    out = {}
    for name in tags.SERIES:
        if (logdir / name).is_dir():
            out[name] = _accumulator(logdir / name)
    return out


GLANCE = "privacy"
DETAIL = tags.DETAIL_CATEGORY
SHADED = "; shaded: advantages not ruled out"
PLAIN_TITLE = "loss (histogram): advantage estimate and certified lower bound" + SHADED
DP_TITLE = (
    "loss (histogram): advantage estimate, certified lower bound and (ε, δ)-DP ceiling" + SHADED
)
GLANCE_TAG = tags.glance_advantage("loss", "histogram")
BAND = tags.band_edges("loss", "histogram")


def _exactly(*tags):
    """The layout's regular expressions of ``tags``: each matches that tag alone."""
    return [re.escape(t) + "$" for t in tags]


# --- event files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("run", ["plain", "dp"])
def test_scalars_one_event_per_check_equal_to_history(run, request):
    monitor, _, acc = request.getfixturevalue(run)[:3]
    assert [r.step for r in monitor.history] == CHECK_STEPS
    written = set(acc.Tags()["scalars"])
    assert set(CORE_TAGS) <= written
    # Every scalar of every report, and nothing else (no constant series pins a chart, #38).
    assert written == set(monitor.history[0].scalars)
    for tag in written:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == CHECK_STEPS, tag
        for e, report in zip(events, monitor.history, strict=True):
            assert _same32(e.value, report.scalars[tag]), (tag, e.value, report.scalars[tag])
    for report in monitor.history:
        s = report.scalars
        for method in ("histogram", "kde"):
            b = f"privacy/loss/{method}"
            assert 0.0 <= s[f"{b}/lower"] <= s[f"{b}/lower_check"] <= 1.0
            assert s[f"{b}/lower"] <= s[f"{b}/value"] <= s[f"{b}/plugin_upper"] <= 1.0
            assert 0.0 <= s[f"{b}/plugin"] <= s[f"{b}/plugin_upper"]
        assert 0.0 <= s["privacy/loss/auc"] <= 1.0


def test_member_risk_histogram_matches_the_reports(plain):
    _, reports, acc = plain
    assert "privacy/loss/member_risk" in acc.Tags()["histograms"]
    events = acc.Histograms("privacy/loss/member_risk")
    assert [e.step for e in events] == CHECK_STEPS
    for e, report in zip(events, reports, strict=True):
        risk = report.queries["loss"].member_risk
        assert risk.shape == (N_MEM,)
        risk = risk[np.isfinite(risk)]
        h = e.histogram_value
        assert h.num == len(risk)
        assert h.min == pytest.approx(risk.min(), abs=1e-12)
        assert h.max == pytest.approx(risk.max(), abs=1e-12)
        assert h.sum == pytest.approx(risk.sum(), rel=1e-9)
        assert h.sum_squares == pytest.approx((risk**2).sum(), rel=1e-9)
        assert sum(h.bucket) == len(risk)


def test_membership_pr_curve(plain):
    _, reports, acc = plain
    tag = "privacy/loss/membership_pr"
    assert tag in acc.Tags()["tensors"]
    assert list(acc.PluginTagToContent("pr_curves")) == [tag]
    events = acc.Tensors(tag)
    assert [e.step for e in events] == CHECK_STEPS
    for e, report in zip(events, reports, strict=True):
        tp, fp, tn, fn, precision, recall = tensor_util.make_ndarray(e.tensor_proto)
        post_m = report.queries["loss"].member_posterior
        post_n = report.queries["loss"].nonmember_posterior
        assert np.all((post_m >= 0) & (post_m <= 1)) and np.all((post_n >= 0) & (post_n <= 1))
        # The lowest threshold takes everyone: members are the positives.
        assert (tp[0], fp[0], tn[0], fn[0]) == (N_MEM, N_NON, 0, 0)
        assert precision[0] == pytest.approx(N_MEM / (N_MEM + N_NON))
        assert recall[0] == 1.0
        np.testing.assert_array_equal(tp + fn, N_MEM)
        np.testing.assert_array_equal(fp + tn, N_NON)
        assert np.all(np.diff(tp) <= 0) and np.all(np.diff(fp) <= 0)
        # sum_j TP_j = sum over members of (1 + their bucket): the member posteriors are the
        # predictions (127 thresholds: bucket of p = floor(floor(126 p) * 127 / 126)).
        buckets = np.minimum(np.floor(np.floor(post_m * 126) * 127 / 126), 126)
        assert tp.sum() == pytest.approx((buckets + 1).sum())
        buckets_n = np.minimum(np.floor(np.floor(post_n * 126) * 127 / 126), 126)
        assert fp.sum() == pytest.approx((buckets_n + 1).sum())


def test_custom_scalar_layout_without_accountant(plain, root):
    # No accountant, no ceiling: the titles say what is drawn; each tag is matched exactly. First
    # one chart per query (a margin chart: each series a run of its own, the estimate's band the
    # advantages not ruled out); then every figure by method. No ε chart first without an
    # accountant or canaries: the black-box bound alone is the certified advantage, in ε.
    charts = _layout(plain[2])
    assert list(charts) == [
        (GLANCE, PLAIN_TITLE),
        (DETAIL, "loss histogram: advantage estimate and certified lower bound"),
        (DETAIL, "loss kde: advantage estimate and certified lower bound"),
        (DETAIL, "epsilon: lower bounds"),
    ]
    assert charts[GLANCE, PLAIN_TITLE] == [(GLANCE_TAG, *BAND)]
    assert charts[DETAIL, "loss kde: advantage estimate and certified lower bound"] == _exactly(
        "privacy/loss/kde/value", "privacy/loss/kde/lower"
    )
    written = plain[2].Tags()["scalars"]
    for (category, _), regexes in charts.items():  # TensorBoard matches each at a tag's start
        if category == DETAIL:
            matched = [t for t in written if any(re.match(r, t) for r in regexes)]
            assert len(matched) == len(regexes)
            assert not any(t.endswith("lower_check") for t in matched)
    # the named series: one run each, holding the first charts' tags and the run id only
    runs = _series_runs(root / "plain")
    assert sorted(runs) == sorted([tags.SERIES_ESTIMATE, tags.SERIES_LOWER, tags.SERIES_BLACK_BOX])
    history = plain[0].history
    for name, figure in ((tags.SERIES_ESTIMATE, "value"), (tags.SERIES_LOWER, "lower")):
        acc = runs[name]
        assert sorted(acc.Tags()["scalars"]) == sorted([GLANCE_TAG, *BAND])
        events = acc.Scalars(GLANCE_TAG)
        assert [e.step for e in events] == CHECK_STEPS
        want = [_f32(r.scalars[f"privacy/loss/histogram/{figure}"]) for r in history]
        assert [_f32(e.value) for e in events] == want
        low, high = ([e.value for e in acc.Scalars(t)] for t in BAND)
        if name == tags.SERIES_ESTIMATE:  # from the certified lower bound up to 1: no ceiling
            lower = [_f32(r.scalars["privacy/loss/histogram/lower"]) for r in history]
            assert (low, high) == (lower, [1.0] * len(CHECK_STEPS))
        else:  # a line's band is the line
            assert low == high == want
        ids = acc.Tensors(RUN_ID_EVENT_TAG)
        assert {tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in ids} == {
            plain[0].run_id
        }
    black_box = runs[tags.SERIES_BLACK_BOX].Scalars(tags.GLANCE_EPSILON)
    for e, r in zip(black_box, history, strict=True):  # the largest over the queries' methods
        bounds = [v for t, v in r.scalars.items() if t.endswith("/epsilon_lower_bound")]
        assert e.value == _f32(max(b for b in bounds if math.isfinite(b)))


def test_every_check_carries_its_run_id(plain):
    monitor, _, acc = plain
    events = acc.Tensors(RUN_ID_EVENT_TAG)
    assert [e.step for e in events] == CHECK_STEPS
    ids = {tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in events}
    assert ids == {monitor.run_id} and len(monitor.run_id) == 32
    assert sorted(acc.PluginTagToContent("text")) == sorted(
        [RUN_ID_EVENT_TAG, tags.most_exposed_event("loss")]
    )


def test_most_exposed_records_are_a_text_table_per_check(plain):
    # index, risk and how many of the checks so far listed the record, read back from the
    # event file; only indices and risks: no record's content
    _, reports, acc = plain
    events = acc.Tensors(tags.most_exposed_event("loss"))
    assert [e.step for e in events] == CHECK_STEPS
    seen = Counter()
    for k, (event, report) in enumerate(zip(events, reports, strict=True), 1):
        q = report.queries["loss"]
        assert len(q.top_records) == 10  # the monitor's top_k
        seen.update(q.top_records)
        text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
        lines = text.split("\n")
        assert lines[0] == (
            "| rank | member index | membership posterior | times among the most exposed |"
        )
        rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:12]]
        assert [int(r[0]) for r in rows] == list(range(1, 11))
        assert [int(r[1]) for r in rows] == list(q.top_records)
        assert [float(r[2]) for r in rows] == pytest.approx(q.top_risks, rel=1e-5)
        assert [r[3] for r in rows] == [f"{seen[i]} of {k}" for i in q.top_records]
        tied = q.top_tied
        assert (len(lines) > 12) == (tied > 0) and (not tied or f"{tied} more" in lines[-1])
    assert max(seen.values()) > 1  # some record is listed at more than one check


def test_event_files_without_run_ids_are_refused_as_written_before_them(tmp_path):
    # figures before any run-id summary were written by a privmon before run ids: not read
    from torch.utils.tensorboard import SummaryWriter

    from privmon.report import read_checks

    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_scalar("privacy/q/histogram/value", 0.2, 10)
    writer.close()
    with pytest.raises(ValueError, match=r"privacy/q/histogram/value' comes before any run id"):
        read_checks(tmp_path)


def test_accountant_epsilon_ceilings_and_layout(dp, root):
    monitor, _, acc, epsilons, accountant = dp
    # The monitor only reads the accountant: 3 + 6 steps, as the training loop made.
    assert accountant.history == [(SIGMA, RATE, 9)]
    assert epsilons[0] < epsilons[1] < epsilons[2]
    for report, eps in zip(monitor.history, epsilons, strict=True):
        s = report.scalars  # the history's figures: float32, 7 significant digits
        assert report.epsilon == pytest.approx(eps, rel=1e-12)
        assert s["privacy/epsilon"] == pytest.approx(eps, rel=1e-7)
        assert s["privacy/ceiling/tanh"] == pytest.approx(privmon.tanh_bound(eps), rel=1e-7)
        assert s["privacy/ceiling/tanh"] == pytest.approx(math.tanh(eps / 2), rel=1e-7)
        eps_delta = (math.exp(eps) - 1 + 2 * DELTA) / (math.exp(eps) + 1)
        assert s["privacy/ceiling/eps_delta"] == pytest.approx(
            privmon.tanh_bound(eps, delta=DELTA), rel=1e-7
        )
        assert s["privacy/ceiling/eps_delta"] == pytest.approx(eps_delta, rel=1e-7)
        violated = any(
            s[f"privacy/loss/{m}/lower"] > s["privacy/ceiling/eps_delta"]
            for m in ("histogram", "kde")
        )
        assert s["privacy/dp_violation"] == float(violated) == float(report.dp_violation)
    for tag in ("privacy/epsilon", "privacy/ceiling/tanh", "privacy/ceiling/eps_delta"):
        assert [e.step for e in acc.Scalars(tag)] == CHECK_STEPS
    assert [e.value for e in acc.Scalars("privacy/epsilon")] == [_f32(e) for e in epsilons]

    charts = _layout(acc)
    ceilings = ["privacy/ceiling/tanh", "privacy/ceiling/eps_delta"]
    eps_title = "ε: ε (accountant) and ε lower bound (black-box attacks)"
    # TensorBoard shows a category's margin charts in the reverse of the layout's order
    assert list(charts)[:2] == [(GLANCE, eps_title), (GLANCE, DP_TITLE)]
    assert charts[GLANCE, eps_title] == [(tags.GLANCE_EPSILON,) * 3]
    band = _series_runs(root / "dp")[tags.SERIES_ESTIMATE]
    ceiling = [_f32(r.scalars["privacy/ceiling/eps_delta"]) for r in monitor.history]
    assert [e.value for e in band.Scalars(BAND[1])] == ceiling  # the band's top: the ceiling
    for method in ("histogram", "kde"):
        b = f"privacy/loss/{method}"
        title = f"loss {method}: advantage estimate and certified lower bound vs DP ceilings"
        assert charts[(DETAIL, title)] == _exactly(f"{b}/value", f"{b}/lower", *ceilings)
    assert charts[(DETAIL, "epsilon: accountant vs measured lower bounds")] == _exactly(
        "privacy/epsilon",
        "privacy/loss/histogram/epsilon_lower_bound",
        "privacy/loss/kde/epsilon_lower_bound",
    )


# --- a real TensorBoard server -------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port, path, **params):
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def server(root, plain, dp, tmp_path_factory):
    if importlib.util.find_spec("tensorboard.main") is None:
        pytest.skip("tensorboard's executable module is not installed")
    port = _free_port()
    log = tmp_path_factory.mktemp("tb_server") / "server.log"
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(root)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--port", str(port), "--host", "127.0.0.1"], stdout=out, stderr=out
        )
    proc.log = log
    try:
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def _wait_for_tags(port, proc, runs, tags, timeout=60.0):
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tensorboard exited with {proc.returncode}: {proc.log.read_text()}")
        try:
            last = _get(port, "/data/plugin/scalars/tags")
            if all(set(tags) <= set(last.get(run, {})) for run in runs):
                return last
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    pytest.fail(f"tensorboard never listed {tags} for {runs}; last answer: {last}")


def _series(port, tag, run, timeout=30.0):
    """One scalar series, polled until every check is loaded (the server loads in background)."""
    deadline = time.monotonic() + timeout
    while True:
        series = _get(port, "/data/plugin/scalars/scalars", tag=tag, run=run)
        if len(series) >= len(CHECK_STEPS) or time.monotonic() > deadline:
            return series
        time.sleep(0.5)


def test_real_tensorboard_server_serves_our_scalars(server, plain, dp):
    port, proc = server
    want = [*CORE_TAGS, "privacy/loss/risk/max"]
    listed = _wait_for_tags(port, proc, ["plain", "dp"], want)
    assert "privacy/epsilon" in listed["dp"] and "privacy/epsilon" not in listed["plain"]

    for run, fixture in (("plain", plain), ("dp", dp)):
        history = fixture[0].history
        for tag in ("privacy/loss/histogram/value", "privacy/loss/kde/lower", "privacy/loss/auc"):
            series = _series(port, tag, run)
            assert [step for _, step, _ in series] == CHECK_STEPS
            for (_, _, value), report in zip(series, history, strict=True):
                assert _same32(value, report.scalars[tag])
    eps = _series(port, "privacy/epsilon", "dp")
    assert [_f32(v) for _, _, v in eps] == [_f32(e) for e in dp[3]]

    pr_tags = _get(port, "/data/plugin/pr_curves/tags")
    assert "privacy/loss/membership_pr" in pr_tags["plain"]
    assert "privacy/loss/membership_pr" in pr_tags["dp"]


def _chart(port, run, title):
    """{tag: [values]} that the server gives a custom-scalar chart of ``run``, asked as the
    dashboard asks: the chart's regular expressions joined into one."""
    layout = _get(port, "/data/plugin/custom_scalars/layout")
    charts = {c["title"]: c for cat in layout["category"] for c in cat["chart"]}
    chart = charts[title]
    if "margin" in chart:  # the margin card's filter: each series' three tags, escaped
        names = {t for m in chart["margin"]["series"] for t in m.values()}
        regexes = [re.escape(t) for t in sorted(names)]
    else:
        regexes = chart["multiline"]["tag"]
    joined = regexes[0] if len(regexes) == 1 else "|".join(f"({r})" for r in regexes)
    got = _get(port, "/data/plugin/custom_scalars/scalars", tag=joined, run=run)
    assert got["regex_valid"]
    return {tag: [v for _, _, v in events] for tag, events in got["tag_to_events"].items()}


def _quantile(sorted_values, p):
    """d3.quantile (the dashboard's): linear interpolation at (n - 1) p."""
    h = (len(sorted_values) - 1) * p
    i = math.floor(h)
    lo, hi = sorted_values[i], sorted_values[min(i + 1, len(sorted_values) - 1)]
    return lo + (hi - lo) * (h - i)


def _y_extent_ignoring_outliers(values):
    """The y-extent TensorBoard's line chart gives ``values`` with *Ignore outliers in chart
    scaling* on (its default): the extent of the values between the 5 % and 95 % quantiles
    (vz_line_chart2's ``extentOfValues``)."""
    finite = sorted(v for v in values if math.isfinite(v))
    lo, hi = _quantile(finite, 0.05), _quantile(finite, 0.95)
    kept = [v for v in finite if lo <= v <= hi]
    return min(kept), max(kept)


def _chart_runs(port, title, runs):
    """{(run, tag): [values]} the server gives a custom-scalar chart, run by run."""
    return {(run, tag): values for run in runs for tag, values in _chart(port, run, title).items()}


def test_real_tensorboard_server_draws_each_named_series_from_its_own_run(server, plain, dp):
    # The first charts: each series a run of its own (TensorBoard's colour and name for it);
    # no constant series pins a chart (#38); the ε chart's y-range, under the dashboard's
    # default outlier clipping (and its 20 % padding), keeps the accountant's last ε.
    port, proc = server
    runs = [f"dp/{name}" for name in tags.SERIES] + [f"plain/{name}" for name in tags.SERIES]
    _wait_for_tags(port, proc, ["plain", "dp"], CORE_TAGS)
    listed = _get(port, "/data/plugin/scalars/tags")
    assert not any("axis" in t for tags_ in listed.values() for t in tags_)
    for run, fixture, title in (("plain", plain, PLAIN_TITLE), ("dp", dp, DP_TITLE)):
        history = fixture[0].history
        names = [tags.SERIES_ESTIMATE, tags.SERIES_LOWER]
        if run == "dp":
            names.append(tags.SERIES_CEILING)
        mine = [r for r in runs if r.startswith(f"{run}/") and r.split("/", 1)[1] in names]
        _wait_for_tags(port, proc, mine, [tags.glance_advantage("loss", "histogram")])
        chart = _chart_runs(port, title, [run, *mine])
        assert sorted({r for r, _ in chart}) == sorted(mine)  # a series a run, none from "."
        figure = {tags.SERIES_ESTIMATE: "privacy/loss/histogram/value",
                  tags.SERIES_LOWER: "privacy/loss/histogram/lower",
                  tags.SERIES_CEILING: "privacy/ceiling/eps_delta"}  # fmt: skip
        for r in mine:
            name = r.split("/", 1)[1]
            want = [_f32(h.scalars[figure[name]]) for h in history]
            assert [_f32(v) for v in chart[r, GLANCE_TAG]] == want, r
            if name == tags.SERIES_ESTIMATE:  # its band: not ruled out, lower bound to ceiling
                top = [_f32(h.scalars.get("privacy/ceiling/eps_delta", 1.0)) for h in history]
                lower = [_f32(h.scalars["privacy/loss/histogram/lower"]) for h in history]
                assert [_f32(v) for v in chart[r, BAND[0]]] == lower
                assert [_f32(v) for v in chart[r, BAND[1]]] == top
        # the chart's y-range (value, lower and upper of every series, as the card computes
        # it, outliers ignored) holds every line: the band's top keeps the chart's top
        values = [v for series in chart.values() for v in series]
        low, high = _y_extent_ignoring_outliers(values)
        pad = 0.1 * (high - low)
        drawn = [v for (r, t), series in chart.items() if t == GLANCE_TAG for v in series]
        assert low - pad <= min(drawn) and max(drawn) <= high + pad
        if run == "plain":
            assert high == 1.0  # no ceiling: the band reaches 1
    eps_runs = [f"dp/{tags.SERIES_ACCOUNTANT}", f"dp/{tags.SERIES_BLACK_BOX}"]
    _wait_for_tags(port, proc, eps_runs, [tags.GLANCE_EPSILON])
    chart = _chart_runs(port, "ε: ε (accountant) and ε lower bound (black-box attacks)", eps_runs)
    values = [v for series in chart.values() for v in series]
    low, high = _y_extent_ignoring_outliers(values)
    padded = high + 0.1 * (high - low)  # the chart pads its extent by 10 % a side
    assert padded >= max(chart[f"dp/{tags.SERIES_ACCOUNTANT}", tags.GLANCE_EPSILON])


def _tensorboard_order(tag):
    """TensorBoard's order of cards (Time Series, Scalars): a digit or '/' before any other
    character (its natural sort; digits compare as numbers, which one digit here does too)."""
    return [(0 if c == "/" or c.isdigit() else 1, c) for c in tag]


def test_the_first_cards_are_the_named_series_charts_no_helper_among_them(dp, root):
    # The Time Series and Scalars tabs sort a run's cards by tag: the first ones are each
    # query's advantage chart, then ε, every series named by its run; the band edges, which the
    # Custom Scalars tab draws, are in a group of their own after every privacy/ card.
    acc = dp[2]
    cards = set(acc.Tags()["scalars"])
    for acc_series in _series_runs(root / "dp").values():
        cards |= set(acc_series.Tags()["scalars"])
    first = sorted(cards, key=_tensorboard_order)[:2]
    assert first == [GLANCE_TAG, tags.GLANCE_EPSILON]
    assert sorted(sorted(cards, key=_tensorboard_order)[-2:]) == sorted(BAND)  # then the bands
    assert not any(t.startswith("privacy/axis") for t in cards)


def test_loss_tnr_and_the_most_vulnerable_records_reach_the_event_file(tmp_path):
    """LOSS TNR as scalars beside the advantage, each source's most vulnerable records by
    LT-IQR as a text table per check, read back with TensorBoard's EventAccumulator."""
    _, reports = traced_run([], writer=str(tmp_path))
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    for fpr in (0.001, 0.01):
        got = [e.value for e in acc.Scalars(tags.loss_tnr("loss", fpr))]
        assert got == pytest.approx([r.scalars[tags.loss_tnr("loss", fpr)] for r in reports])
    for source in (tags.TRAINING_LOOP, "loss"):
        events = acc.Tensors(tags.most_vulnerable(source) + "/text_summary")
        assert [e.step for e in events] == [2, 4, 6]
        for event, report in zip(events, reports, strict=True):
            text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
            lines = text.split("\n")
            assert lines[0] == "| rank | record index | LT-IQR |"
            rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
            top = report.vulnerable[source]
            assert [int(r[1]) for r in rows] == list(top.records) and len(rows) == 4
            assert [float(r[2]) for r in rows] == pytest.approx(top.scores, rel=1e-5)
