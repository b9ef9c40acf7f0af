"""The command line: ``privmon --version``, ``privmon audit`` on saved scores (.npy, .csv, .pt;
figures equal to the functional API's; one-line errors with exit code 2), and the demo's
messages for a missing optional dependency."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import privmon
from privmon.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def scores():
    rng = np.random.default_rng(1)
    return rng.normal(0.6, 1.0, 800), rng.normal(0.0, 1.0, 900)


def _save(tmp_path, name, arr):
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, arr)
    elif name.endswith(".csv"):
        np.savetxt(path, arr, delimiter=",", header="score", comments="")
    else:
        torch.save(torch.as_tensor(arr), path)
    return str(path)


def _audit_json(capsys, *argv):
    assert main(["audit", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("suffix", [".npy", ".csv", ".pt"])
def test_audit_json_equals_the_functional_api(tmp_path, capsys, scores, suffix):
    m, h = scores
    out = _audit_json(
        capsys, _save(tmp_path, "m" + suffix, m), _save(tmp_path, "h" + suffix, h), "--delta", "0.1"
    )
    assert out["n_members"] == 800 and out["n_nonmembers"] == 900 and out["dim"] == 1
    for method in ("histogram", "kde"):
        # each method certified at delta / 2: the two lower bounds hold jointly at 0.9
        est = privmon.optimal_advantage(m, h, method=method, delta=0.05)
        got = out["advantage"][method]
        assert got["delta"] == 0.05
        for field in ("value", "lower", "plugin", "upper"):
            assert got[field] == pytest.approx(getattr(est, field), abs=1e-12), (method, field)
        assert out["epsilon_lower_bound"][method] == pytest.approx(
            privmon.epsilon_lower_bound(est.lower), abs=1e-12
        )
    assert out["roc"] == pytest.approx(privmon.roc_summary(m, h))
    assert 0.6 < out["roc"]["auc"] < 0.72  # N(0.6, 1) vs N(0, 1): Phi(0.6 / sqrt 2) = 0.664


def test_audit_text_names_bounds_and_estimates(tmp_path, capsys, scores):
    m, h = scores
    argv = ["audit", _save(tmp_path, "m.npy", m), _save(tmp_path, "h.npy", h)]
    assert main([*argv, "--methods", "histogram", "--fpr", "0.01"]) == 0
    text = capsys.readouterr().out
    est = privmon.optimal_advantage(m, h, method="histogram", delta=0.05)
    row = next(line for line in text.splitlines() if line.strip().startswith("histogram "))
    assert [float(v) for v in row.split()[1:]] == pytest.approx(
        [est.value, est.lower, est.plugin, est.upper], abs=6e-5
    )
    assert "certified LOWER BOUND" in text and "NOT a certified upper bound" in text
    assert "TPR at FPR 0.01" in text and "epsilon >=" in text and "exchangeable" in text


def test_audit_orientation_and_multidimensional_scores(tmp_path, capsys, scores):
    m, h = scores
    fm, fh = _save(tmp_path, "m.npy", m), _save(tmp_path, "h.npy", h)
    lower = _audit_json(capsys, fm, fh, "--orientation", "lower", "--methods", "histogram")
    assert lower["roc"]["auc"] == pytest.approx(1 - privmon.auc(m, h), abs=1e-12)
    rng = np.random.default_rng(2)
    m2 = np.c_[m, rng.normal(size=800)]
    h2 = np.c_[h, rng.normal(size=900)]
    two = _audit_json(
        capsys, _save(tmp_path, "m2.npy", m2), _save(tmp_path, "h2.npy", h2), "--methods", "kde"
    )
    assert two["dim"] == 2 and two["roc"] is None
    est = privmon.optimal_advantage(m2, h2, method="kde", delta=0.05)
    assert two["advantage"]["kde"]["value"] == pytest.approx(est.value, abs=1e-12)


def test_audit_json_writes_non_finite_as_null(tmp_path, capsys):
    # members and non-members perfectly separated: advantage 1, epsilon lower bound inf
    out = _audit_json(
        capsys,
        _save(tmp_path, "m.npy", np.linspace(10, 11, 300)),
        _save(tmp_path, "h.npy", np.linspace(0, 1, 300)),
        "--methods",
        "histogram",
        "--delta",
        "0.5",
    )
    eps = out["epsilon_lower_bound"]["histogram"]
    assert eps is None or eps > 3  # null where the bound is infinite
    assert out["roc"]["auc"] == 1.0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: str(p / "missing.npy"), "missing.npy: no such file"),
        (lambda p: _write(p / "s.txt", "1\n2\n"), "must be a .npy, .csv, .pt file"),
        (lambda p: _write(p / "s.csv", "a,b\nx,y\n"), "s.csv: cannot read scores"),
        (lambda p: _write(p / "s.csv", ""), "s.csv"),
        (lambda p: _npy(p / "s.npy", np.zeros((3, 2, 2))), "shape (n,) or (n, d)"),
        (lambda p: _npy(p / "o.npy", np.array([{"a": 1}], dtype=object)), "o.npy: cannot read"),
        (lambda p: _pt(p / "d.pt", {"scores": torch.ones(3)}), "expected a saved tensor"),
        (lambda p: _write(p / "x.pt", "not a zip"), "x.pt: cannot read scores"),
    ],
)
def test_audit_bad_files_one_line_exit_2(tmp_path, capsys, scores, make, message):
    good = _save(tmp_path, "good.npy", scores[1])
    assert main(["audit", make(tmp_path), good]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("privmon audit: error: ")
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        # A decimal comma (a spreadsheet's CSV in many locales) was read as a second column.
        ("dc.csv", "0,53\n1,27\n-0,4\n", "every row is two whole numbers"),
        ("dch.csv", "score\n0,53\n1,27\n", "the header names 1 column(s) but the rows hold 2"),
        ("semi.csv", "a;b\n0,5;1,2\n0,7;1,1\n", "fields are separated by ';'"),
        ("ragged.csv", "0,53\n1\n", "line 2 has 1 field(s), the first record 2"),
        # pandas' to_csv() writes the row index as a first column: it was read as a score.
        ("pandas.csv", ",score\n0,0.5\n1,0.7\n2,0.1\n", "first column is a row index"),
        ("named.csv", "index,score\n4,0.5\n9,0.7\n12,0.1\n", "header cell is 'index'"),
        ("counted.csv", "0,0.5\n1,0.7\n2,0.1\n3,0.2\n", "it counts 0, 1, 2, …"),
    ],
    ids=["decimal-comma", "decimal-comma-header", "semicolons", "ragged", "pandas-index",
         "index-column", "counting-column"],
)  # fmt: skip
def test_audit_refuses_csv_it_would_misread(tmp_path, capsys, name, text, message):
    # Members and non-members saved alike: each was read as 2-D scores and audited.
    members = _write(tmp_path / name, text)
    assert main(["audit", members, _write(tmp_path / f"h_{name}", text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"privmon audit: error: {members}: ")
    assert message in err


@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_audit_refuses_complex_scores(tmp_path, capsys, scores, suffix):
    # The imaginary parts were dropped without a word.
    m, h = scores
    bad = _save(tmp_path, "m" + suffix, m + 1j * h[:800])
    assert main(["audit", bad, _save(tmp_path, "h.npy", h)]) == 2
    err = capsys.readouterr().err
    assert "scores must be real numbers, got a complex array" in err


def test_audit_reads_the_csv_files_it_always_read(tmp_path, capsys, scores):
    m, h = scores
    fh = _save(tmp_path, "h.npy", h)
    expected = _audit_json(capsys, _save(tmp_path, "m.npy", m), fh)
    variants = {
        "numpy.csv": lambda p: np.savetxt(p, m, header="score"),  # "# score" comment header
        "plain.csv": lambda p: np.savetxt(p, m),
        # a spreadsheet's: a byte-order mark, CRLF line ends
        "excel.csv": lambda p: p.write_bytes(
            b"\xef\xbb\xbfscore\r\n" + "\r\n".join(repr(float(v)) for v in m).encode()
        ),
    }
    for name, write in variants.items():
        write(tmp_path / name)
        assert _audit_json(capsys, str(tmp_path / name), fh) == expected, name
    two_m, two_h = tmp_path / "two_m.csv", tmp_path / "two_h.csv"
    np.savetxt(two_m, np.c_[m, m**2], delimiter=",", header="a,b", comments="")
    np.savetxt(two_h, np.c_[h, h**2], delimiter=",", header="a,b", comments="")
    assert _audit_json(capsys, str(two_m), str(two_h))["dim"] == 2


def test_audit_bad_data_one_line_exit_2(tmp_path, capsys):
    nan = _save(tmp_path, "nan.npy", np.full(5, np.nan))
    good = _save(tmp_path, "good.npy", np.arange(5.0))
    assert main(["audit", nan, good]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "member_scores has no finite scores" in err


def test_console_script_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "privmon.cli", "audit", str(tmp_path / "a.npy"), "b.csv"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"privmon audit: error: {tmp_path}/a.npy: no such file"
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "privmon.cli", "audit", "a.npy", "b.npy", "--prior", "1.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--prior: must be in the open interval (0, 1)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"privmon {privmon.__version__}"
    from importlib.metadata import version

    assert privmon.__version__ == version("privmon")


@pytest.mark.parametrize(
    ("argv", "missing", "extra"), [([], "sklearn", "demo"), (["--dp"], "opacus", "dp")]
)
def test_demo_without_an_optional_dependency_says_what_to_install(
    monkeypatch, capsys, tmp_path, argv, missing, extra
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    assert main(["demo", "--logdir", str(tmp_path), "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pip install 'privmon[{extra}]'" in err
    assert not list(tmp_path.iterdir())  # nothing was started


def _write(path, text):
    path.write_text(text)
    return str(path)


def _npy(path, arr):
    np.save(path, arr, allow_pickle=True)
    return str(path)


def _pt(path, obj):
    torch.save(obj, path)
    return str(path)


# --- privmon audit --synthetic S --members M --heldout H --reference R (tables) ----------------
# The figures equal audit_synthetic's: tests/audit/test_audit_synthetic.py, on the CPS 1988 survey.


@pytest.fixture
def tables(tmp_path):
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(0)

    def table(n):
        return pd.DataFrame(
            {"wage": rng.lognormal(6.0, 0.5, n), "region": rng.choice(["north", "south"], n)}
        )

    out = {}
    for flag, n in (("--synthetic", 60), ("--members", 60), ("--heldout", 60), ("--reference", 90)):
        path = tmp_path / f"{flag[2:]}.csv"
        table(n).to_csv(path, index=False)
        out[flag] = str(path)
    return out


def _table_argv(tables, **replace):
    files = {**tables, **replace}
    return ["audit", *(x for kv in files.items() for x in kv), "--attacks", "dcr"]


def test_audit_tables_prints_the_table_and_json(capsys, tables):
    assert main(_table_argv(tables)) == 0
    out = capsys.readouterr().out
    assert out.startswith("membership inference on a synthetic table: 60 members, 60 held-out")
    assert "dcr" in out and "certified lower bounds" in out
    got = _audit_json(capsys, *_table_argv(tables)[1:], "--subgroup", "region", "--delta", "0.1")
    assert got["attacks"]["dcr"]["advantage"]["histogram"]["delta"] == 0.05
    assert sorted(got["attacks"]["dcr"]["subgroups"]) == ["north", "south"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["m.npy", "h.npy"], "give saved scores (MEMBERS NONMEMBERS) or tables"),
        (["--orientation", "lower"], "--orientation reads saved scores"),
        (["--attacks", "lira"], "argument --attacks: invalid choice: 'lira'"),
    ],
)
def test_audit_tables_bad_arguments_usage_and_exit_2(capsys, tables, extra, message):
    with pytest.raises(SystemExit) as exit_:
        main(["audit", *extra, *_table_argv(tables)[1:]])  # before --attacks' values
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: privmon audit") and err.splitlines()[-1].startswith(
        "privmon audit: error: "
    )
    assert message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--synthetic", "s.csv", "--members", "m.csv"], "missing --heldout, --reference"),
        (["m.npy", "h.npy", "--subgroup", "region"], "--subgroup: only with tables"),
        ([], "give MEMBERS NONMEMBERS (saved scores) or --synthetic"),
    ],
)
def test_audit_mode_arguments_usage_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["audit", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def _index_csv(tmp_path):
    import pandas as pd

    path = tmp_path / "with_index.csv"
    pd.DataFrame({"wage": [1.0, 2.0, 3.0], "region": ["a", "b", "a"]}).to_csv(path)
    return str(path)


def _header_only(tmp_path):
    path = tmp_path / "header.csv"
    path.write_text("wage,region\n")
    return str(path)


def _empty(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("")
    return str(path)


def _no_region(tmp_path):
    import pandas as pd

    path = tmp_path / "no_region.csv"
    pd.DataFrame({"wage": [1.0, 2.0, 3.0]}).to_csv(path, index=False)
    return str(path)


@pytest.mark.parametrize(
    ("flag", "make", "message"),
    [
        ("--members", lambda p: str(p / "m.xlsx"), "m.xlsx: a table must be a .csv or .parquet"),
        ("--members", lambda p: str(p / "absent.csv"), "absent.csv: no such file"),
        ("--heldout", _index_csv, "with_index.csv: the first column is a row index"),
        ("--reference", _header_only, "header.csv: the table has no records"),
        ("--synthetic", _empty, "empty.csv: cannot read the table (No columns to parse"),
        ("--heldout", _no_region, "heldout's columns differ from the reference's: missing"),
    ],
)
def test_audit_tables_bad_files_one_line_exit_2(tmp_path, capsys, tables, flag, make, message):
    assert main(_table_argv(tables, **{flag: make(tmp_path)})) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("privmon audit: error: ")
    assert message in err


def _parquet_engine():
    return importlib.util.find_spec("pyarrow") or importlib.util.find_spec("fastparquet")


def test_audit_tables_read_parquet_or_say_what_it_needs(tmp_path, capsys, tables):
    import pandas as pd

    path = str(tmp_path / "members.parquet")
    if not _parquet_engine():
        open(path, "wb").close()
        assert main(_table_argv(tables, **{"--members": path})) == 2
        err = capsys.readouterr().err
        assert err == (
            f"privmon audit: error: {path}: reading parquet needs pyarrow or fastparquet, which "
            "this Python lacks (pip install pyarrow), or save the table as .csv\n"
        )
        return
    pd.read_csv(tables["--members"]).to_parquet(path)
    want = _audit_json(capsys, *_table_argv(tables)[1:])
    assert _audit_json(capsys, *_table_argv(tables, **{"--members": path})[1:]) == want


def test_audit_tables_errors_name_no_record_value(tmp_path, capsys, tables):
    import pandas as pd

    secret = "SECRET-4417"
    table = pd.read_csv(tables["--members"])
    table["wage"] = table["wage"].astype(object)
    table.loc[2, "wage"] = secret
    path = tmp_path / "m_text.csv"
    table.to_csv(path, index=False)
    assert main(_table_argv(tables, **{"--members": str(path)})) == 2
    err = capsys.readouterr().err
    assert "members's column 'wage' is numeric in the reference" in err and secret not in err
