"""What the report's pages are made of (:mod:`~privmon.report.page` for one run,
:mod:`~privmon.report.compare` for several): the style sheet, tables that scroll inside the
page's column, images, the glossary of the page's terms (each shown where it is used, as a link
with a one-line explanation, and listed at the page's end), and writing a page atomically."""

from __future__ import annotations

import contextlib
import html
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from privmon.report.formatting import fmt

__all__ = [
    "CSS",
    "GLOSSARY",
    "REPORT_NAME",
    "explain",
    "glossary_html",
    "head",
    "img",
    "save_page",
    "table",
]

REPORT_NAME = "privacy_report.html"
"""The report's file name in the log directory when no output path is given."""

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1200px;
margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
.meta{color:#666;font-size:.9em}
.verdict{border-radius:6px;padding:1em 1.2em;margin:1.2em 0;border-left:8px solid}
.verdict h2{border:none;margin:0 0 .4em 0;font-size:1.3em}
.v-none{background:#eef8ee;border-color:#2e7d32}
.v-leakage{background:#fff0e6;border-color:#e65100}.v-violation{background:#fdecea;border-color:#b71c1c}
.v-empty{background:#f4f4f4;border-color:#888}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:.88em;margin:.6em 0}
th,td{border:1px solid #ddd;padding:.25em .55em;text-align:right}
th{background:#f6f6f6} td.l,th.l{text-align:left}
img{max-width:100%;height:auto;display:block;margin:.6em 0}
.caption{color:#555;font-size:.88em}
.note{background:#f4f6fb;border-left:4px solid #6b7fc4;padding:.5em .8em;font-size:.9em}
code{background:#f3f3f3;padding:0 .2em}
a.term{color:inherit;text-decoration:underline dotted}
dl.glossary dt{font-weight:600;margin-top:.4em} dl.glossary dd{margin-left:1.5em}
"""
"""The pages' style sheet: a table wider than the column scrolls inside it (``.scroll``)."""

GLOSSARY: dict[str, str] = {
    "largest certified lower": "the run's largest certified lower bound for this query and "
    "method, and its step: the figure the verdict names",
    "certified lower": "a lower bound on the true advantage that holds, with every other "
    "certified bound of the run, with probability at least 1 − δ",
    "plug-in + McDiarmid": "the paper's plug-in figure plus its McDiarmid half-width: the "
    "spread of the estimator around its own mean, biased up, so it bounds nothing",
    "plug-in": "the MACE paper's estimate of the advantage read straight off the histogram or "
    "KDE; it over-reports small leaks",
    "W_N / U_N": "the MACE paper's plug-in advantages: W_N from histograms, U_N from kernel "
    "density estimates (KDE)",
    "McDiarmid": "a concentration inequality: how far an average of many records can stray "
    "from its mean",
    "ε lower bound": "the smallest ε that a DP guarantee would need to allow the certified "
    "advantage (0: no DP claim is contradicted)",
    "AUC": "area under the ROC curve: the chance that a random member scores above a random "
    "non-member (0.5: chance)",
    "TPR@FPR=1%": "the share of members an attack finds when it accuses 1% of non-members",
    "dropped": "scores that were NaN or infinite, left out and counted",
    "detectable": "the smallest advantage this check's certificate finds in half the runs at "
    "its audit sizes and δ",
    "|f_p|": "individual risk of one record: how far the best attacker's posterior for it lies "
    "from a coin flip, 2·P(member | query) − 1 in absolute value",
    "MACE eq. 8": "the MACE paper's definition of individual risk f_p(z) = (p·P − (1 − p)·Q) / "
    "(p·P + (1 − p)·Q), from the member (P) and non-member (Q) densities",
    "(ε, δ) ceiling": "the largest advantage an (ε, δ)-DP model allows any attack",
    "ε-DP ceiling (tanh)": "the largest advantage an ε-DP model allows: tanh(ε/2) at prior 0.5",
    "trivial floor |2p − 1|": "the advantage of always guessing the likelier side at prior p; "
    "every figure is at least this",
    "posterior": "P(member | what the attacker observes) = (1 + f_p)/2",
    "Bayes-rule attack": "the best attack on the query: it says member where members are more "
    "likely than non-members",
    "symlog": "an axis linear near 0 and logarithmic above 0.001, to show low false positive rates",
    "one-run canary audit": "an ε lower bound from planted canaries, each included in training "
    "with probability ½, read in one training run",
    "DP mechanism checks": "tests of the assumptions the accountant's ε rests on (clipping, "
    "noise, sampling, steps), run on the optimizer itself",
    "δ": "the chance a certified figure is allowed to be wrong (the monitor's confidence "
    "budget), or DP's δ beside ε",
}
"""Each technical term of the pages and its one-line plain explanation (longer terms are
matched first, so ``plug-in + McDiarmid`` is not read as ``plug-in``)."""

_ORDER = sorted(GLOSSARY, key=len, reverse=True)
_PATTERN = re.compile("|".join(re.escape(html.escape(t)) for t in _ORDER))
_BY_ESCAPED = {html.escape(t): t for t in GLOSSARY}


def _slug(term: str) -> str:
    return "term-" + "-".join(re.findall(r"\w+", term.lower()))


def explain(text: str, used: set[str] | None = None) -> str:
    """``text`` as HTML, each glossary term in it a link to its entry with its explanation as
    a tooltip (``title``); ``used`` collects the terms found.

    Examples:
        >>> from privmon.report.blocks import explain
        >>> print(explain("W_N / U_N & more"))  # doctest: +ELLIPSIS
        <a class="term" href="#term-w_n-u_n" title="the MACE ...">W_N / U_N</a> &amp; more
    """

    def link(match: re.Match[str]) -> str:
        term = _BY_ESCAPED[match.group(0)]
        if used is not None:
            used.add(term)
        tip = html.escape(GLOSSARY[term], quote=True)
        return f'<a class="term" href="#{_slug(term)}" title="{tip}">{match.group(0)}</a>'

    return _PATTERN.sub(link, html.escape(text))


def glossary_html(used: Iterable[str]) -> str:
    """The glossary of the terms ``used`` on a page, in the glossary's order ("" for none)."""
    found = set(used)
    shown = [t for t in GLOSSARY if t in found]
    if not shown:
        return ""
    items = "".join(
        f'<dt id="{_slug(t)}">{html.escape(t)}</dt><dd>{html.escape(GLOSSARY[t])}</dd>'
        for t in shown
    )
    return f'<h2>Terms used on this page</h2><dl class="glossary">{items}</dl>'


def head(title: str) -> str:
    """A page's beginning, up to its ``<h1>`` title (the style sheet inline)."""
    esc = html.escape(title)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc}</title><style>{CSS}</style></head><body>\n<h1>{esc}</h1>"
    )


def img(b64: str, alt: str) -> str:
    """A base64 PNG as an ``<img>``."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    left: int = 1,
    used: set[str] | None = None,
) -> str:
    """An HTML table inside a ``.scroll`` block (a wide one scrolls inside the page's column);
    the first ``left`` columns left-aligned, numbers through :func:`~privmon.report.formatting.
    fmt`; a header that is a glossary term carries its explanation (``used`` collects it).

    Examples:
        >>> from privmon.report.blocks import table
        >>> page = table(["query", "AUC"], [["loss", 0.61234]])
        >>> page.startswith('<div class="scroll"><table>'), '<th title="area under' in page
        (True, True)
    """

    def cell(tag: str, i: int, v: Any) -> str:
        cls = ' class="l"' if i < left else ""
        text = v if isinstance(v, str) else fmt(v)
        tip = GLOSSARY.get(text) if tag == "th" else None
        if tip is not None:
            if used is not None:
                used.add(text)
            cls += f' title="{html.escape(tip, quote=True)}"'
        return f"<{tag}{cls}>{html.escape(text)}</{tag}>"

    header_row = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows
    )
    return f'<div class="scroll"><table><tr>{header_row}</tr>{body}</table></div>'


def save_page(
    out: str | os.PathLike[str], render: Callable[[], str], *, inputs: Sequence[str] = ()
) -> str:
    """Write the page ``render()`` gives to ``out`` atomically (:func:`_write_file`); a link, a
    directory or one of the ``inputs`` files there is refused before it is rendered (its plots
    drawn). Returns the path written."""
    out = os.fspath(out)
    if not out or out.endswith(("/", os.sep)):
        raise ValueError(f"the output path {out!r} is not a file name: pass e.g. {REPORT_NAME}")
    existing = _output_status(out)
    if existing is not None and any(
        os.path.isfile(path) and os.path.samefile(out, path) for path in inputs
    ):
        raise ValueError(f"the output path {out!r} is the input file: pass another --out")
    try:
        _write_file(out, render().encode("utf-8"), existing)
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, out) from err  # a failed write: name the file
    return out


def _output_status(path: str) -> os.stat_result | None:
    """``lstat`` of the output path (None when it does not exist); a symbolic link or a
    directory there is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(
            f"the output path {path!r} is a symbolic link: privmon report does not write "
            "through links (remove it, or pass the file it points to)"
        )
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(
            f"the output path {path!r} is a directory: pass a file name, e.g. "
            f"{os.path.join(path, REPORT_NAME)}"
        )
    return st


def _write_file(path: str, data: bytes, existing: os.stat_result | None) -> None:
    """Write ``data`` to ``path`` (``existing``: its ``lstat``) without following a link there.

    A regular file (or a new one) is written to a temporary file beside it and renamed over
    it: readers never see half a page, and a failed write (a full disk) leaves the previous
    report whole, with its permission bits kept. A device or a pipe (``/dev/null``) is
    written in place.
    """
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never an existing file or link; mode 0o666 less the umask, as open() gives
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the report
        if existing is not None:
            os.chmod(temp, stat.S_IMODE(existing.st_mode))
        os.replace(temp, path)  # a link created at ``path`` meanwhile is replaced, not followed
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
