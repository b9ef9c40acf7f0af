"""The table synthesizers privmon watches while they fit, behind one small interface
(:class:`SynthesizerModel`): ctgan's ``CTGAN`` and ``TVAE``, and SDV's single-table
``CTGANSynthesizer``, ``TVAESynthesizer`` and ``CopulaGANSynthesizer``, which wrap them.

Each says what its ``sample()`` releases, in the data space, also in the middle of a fit (when
SDV's own ``sample`` refuses), leaving every state as it found it (modes, BatchNorm statistics,
the library's random states); which modules that release reads; how many epochs are done and
planned; and copies and restores those modules' weights. The libraries keep the parts a monitor
needs in private attributes (ctgan: ``CTGAN._generator``, ``CTGAN._epochs``; SDV: the wrapped
``_model``, ``_sample``, ``_data_processor`` and the ``_fitted`` flags): they are read here
alone, checked against ctgan 0.12.0 and 0.12.1 and SDV 2.0.
"""

from __future__ import annotations

import datetime
import sys
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from privmon._validation import is_table
from privmon.queries.generator import GeneratorQuery

__all__ = ["CtganModel", "SdvModel", "SynthesizerModel", "SynthesizerQuery", "synthesizer_model"]


class SynthesizerModel:
    """A synthesizer as the monitor reads it; :func:`synthesizer_model` picks the subclass.

    Examples:
        >>> import pandas as pd
        >>> from ctgan import TVAE
        >>> from privmon.queries.synthesizers import synthesizer_model
        >>> table = pd.DataFrame({"x": [0.1 * i for i in range(40)], "c": ["a", "b"] * 20})
        >>> tvae = TVAE(epochs=2, batch_size=20, enable_gpu=False)
        >>> model = synthesizer_model(tvae)
        >>> model.epochs_done(), model.planned_epochs()
        (0, 2)
        >>> tvae.fit(table, discrete_columns=["c"])
        >>> model.epochs_done(), list(model.sample(3).columns)
        (2, ['x', 'c'])
    """

    def __init__(self, synthesizer: Any) -> None:
        self.synthesizer = synthesizer
        self._last: tuple[tuple[Any, ...], Any] | None = None  # the last draw and its key

    @property
    def name(self) -> str:
        """The synthesizer's class name, for messages."""
        return type(self.synthesizer).__name__

    @property
    def model(self) -> Any:
        """The ctgan model that trains (for SDV, the one the synthesizer wraps; None before
        its fit starts)."""
        return self.synthesizer

    def modules(self) -> tuple[nn.Module, ...]:
        """The modules ``sample()`` reads (CTGAN's generator, TVAE's decoder)."""
        model = self.model
        module = None if model is None else _generator(model)
        if module is None:
            raise ValueError(
                f"the {self.name} is not fitted yet: its generator does not exist until its "
                "fit starts"
            )
        return (module,)

    def epochs_done(self) -> int:
        """Epochs completed by the current (or last) fit, read from the model's public
        ``loss_values`` (one row per epoch, or per batch with its epoch)."""
        losses = None if self.model is None else getattr(self.model, "loss_values", None)
        if losses is None or len(losses) == 0:
            return 0
        return int(losses["Epoch"].iloc[-1]) + 1

    def planned_epochs(self) -> int | None:
        """The epochs a fit runs (None when unknown)."""
        raise NotImplementedError

    def sample(self, n: int) -> Any:
        """``n`` records as the synthesizer's ``sample()`` releases them (a DataFrame). Asked
        again for ``n`` records of the same weights (the queries of one check), it gives the
        same table, drawn once: the attacks of a check read one release."""
        self.modules()  # refuses an unfitted model
        key = (n, self.epochs_done(), self._fingerprint())
        if self._last is None or self._last[0] != key:
            self._last = None  # the old table goes before the new one is drawn
            self._last = (key, self._draw(n))
        return self._last[1]

    def _draw(self, n: int) -> Any:
        raise NotImplementedError

    def _fingerprint(self) -> tuple[float, ...]:
        """The released modules' state, summed tensor by tensor: it moves with every step."""
        with torch.no_grad():
            return tuple(
                float(t.double().sum()) for m in self.modules() for t in m.state_dict().values()
            )

    def weights(self) -> list[dict[str, torch.Tensor]]:
        """A copy of the released modules' weights and buffers (one state dict each)."""
        return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in self.modules()]

    def load_weights(self, weights: list[dict[str, torch.Tensor]]) -> None:
        """Put :meth:`weights` back (in place: the optimizers keep their parameters)."""
        with torch.no_grad():
            for module, state in zip(self.modules(), weights, strict=True):
                module.load_state_dict(state)

    def end_stopped_fit(self) -> None:
        """What the library's ``fit`` does after its epochs, for a fit stopped mid-way."""

    @contextmanager
    def _as_found(self) -> Iterator[None]:
        """Leave the released modules' modes and buffers and the model's random states as they
        were: ctgan samples in whatever mode the generator is in (CTGAN's BatchNorm in train
        mode updates its statistics; TVAE's sample leaves its decoder in eval mode), and a
        model with a random state set advances it with every sample."""
        modules = [m for root in self.modules() for m in root.modules()]
        modes = [(m, m.training) for m in modules]
        buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers(recurse=False)]
        model = self.model
        states = getattr(model, "random_states", None)
        saved = None if states is None else (states[0].get_state(), states[1].get_state())
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)
            if states is not None and saved is not None:
                states[0].set_state(saved[0])
                states[1].set_state(saved[1])
                model.random_states = states


class CtganModel(SynthesizerModel):
    """ctgan's ``CTGAN`` or ``TVAE``: ``sample()`` is the model's own."""

    def planned_epochs(self) -> int | None:
        epochs = getattr(self.model, "epochs", None)  # TVAE's is public, CTGAN's is not
        epochs = getattr(self.model, "_epochs", None) if epochs is None else epochs
        return int(epochs) if isinstance(epochs, int) else None

    def _draw(self, n: int) -> Any:
        with self._as_found():
            return self.model.sample(n)


class SdvModel(SynthesizerModel):
    """An SDV single-table synthesizer wrapping a ctgan model. Its release is what SDV's
    ``sample()`` computes — the model's sample, then SDV's reverse transform and its
    constraints' — called part by part, since SDV refuses to sample before its fit returns;
    SDV's fixed sampling seed is not applied (the monitor's checks draw from the global
    random streams, which it restores)."""

    @property
    def model(self) -> Any:
        return getattr(self.synthesizer, "_model", None)

    def planned_epochs(self) -> int | None:
        epochs = self.synthesizer.get_parameters().get("epochs")
        return int(epochs) if isinstance(epochs, int) else None

    def _draw(self, n: int) -> Any:
        synthesizer = self.synthesizer
        with self._as_found():
            raw = synthesizer._sample(n)
            table = synthesizer._data_processor.reverse_transform(raw)
            table = synthesizer.reverse_transform_constraints(table)
        return table

    def end_stopped_fit(self) -> None:
        """SDV's ``fit_processed_data`` marks the synthesizer fitted after its model's fit
        returns; a stopped fit never returns, so the marks are set here."""
        s = self.synthesizer
        version = sys.modules.get("sdv.version")  # imported by SDV's synthesizers
        s._fitted = True
        s._fitted_date = datetime.datetime.today().strftime("%Y-%m-%d")
        s._fitted_sdv_version = getattr(version, "community", None)
        s._fitted_sdv_enterprise_version = getattr(version, "enterprise", None)


def _generator(model: Any) -> nn.Module | None:
    """The module a ctgan model samples with: CTGAN's generator, TVAE's decoder."""
    module = getattr(model, "decoder", None)  # TVAE
    if module is None:
        module = getattr(model, "_generator", None)  # CTGAN
    return module if isinstance(module, nn.Module) else None


_MODELS: weakref.WeakKeyDictionary[Any, SynthesizerModel] = weakref.WeakKeyDictionary()


def synthesizer_model(synthesizer: Any) -> SynthesizerModel:
    """The :class:`SynthesizerModel` of a ctgan ``CTGAN`` / ``TVAE`` or an SDV single-table
    synthesizer that wraps one, one per synthesizer (so its queries share each check's draw); a
    TypeError names what is accepted otherwise."""
    try:
        model = _MODELS.get(synthesizer)
    except TypeError:  # unhashable (a DataFrame, say): no synthesizer, as _new_model says
        model = None
    if model is None:
        model = _MODELS[synthesizer] = _new_model(synthesizer)
    return model


def _new_model(synthesizer: Any) -> SynthesizerModel:
    ctgan = sys.modules.get("ctgan.synthesizers.base")
    sdv = sys.modules.get("sdv.single_table.base")
    sdv_ctgan = sys.modules.get("sdv.single_table.ctgan")  # CopulaGAN's class derives from it
    if ctgan is not None and isinstance(synthesizer, ctgan.BaseSynthesizer):
        return CtganModel(synthesizer)
    if sdv is not None and isinstance(synthesizer, sdv.BaseSingleTableSynthesizer):
        wrappers = (sdv_ctgan.CTGANSynthesizer, sdv_ctgan.TVAESynthesizer) if sdv_ctgan else ()
        if isinstance(synthesizer, wrappers):
            return SdvModel(synthesizer)
        raise TypeError(
            f"{type(synthesizer).__name__} trains no torch model epoch by epoch; privmon "
            "watches SDV's CTGANSynthesizer, TVAESynthesizer and CopulaGANSynthesizer"
        )
    raise TypeError(
        "synthesizer must be a ctgan CTGAN or TVAE, or an SDV CTGANSynthesizer, "
        f"TVAESynthesizer or CopulaGANSynthesizer, got {type(synthesizer).__name__}"
    )


class SynthesizerQuery(GeneratorQuery):
    """Attack a table synthesizer's release at every check: ``prepare`` draws ``n_samples``
    records from its ``sample()`` (:class:`SynthesizerModel`: in the middle of a fit too, in
    the data space an attacker holds, with every state left as found), and each audit batch (a
    DataFrame of the reference's columns) is scored against them with
    :class:`~privmon.queries.GeneratorQuery`'s attacks on encoded tables (one
    :class:`~privmon.attacks.TableEncoder`, fitted on ``reference``). The synthesizer's modules
    are not put in eval mode: they sample as the synthesizer's own ``sample()`` does.

    Args:
        synthesizer: a ctgan ``CTGAN`` / ``TVAE`` or an SDV ``CTGANSynthesizer``,
            ``TVAESynthesizer`` or ``CopulaGANSynthesizer``; it may be unfitted when the query
            is built (not when it is first prepared).
        reference: a DataFrame of population records, disjoint from the members and the
            held-out records (the attacker's data; the encoder is fitted on it alone).
        attack: as for :class:`~privmon.queries.GeneratorQuery` (``"domias"``, ``"eq1"``,
            ``"gan_leaks"``, ``"gan_leaks_cal"``, ``"monte_carlo"``, ``"dcr"``).
        n_samples: records drawn per check.
        categorical: the reference's categorical columns, if not its non-numeric ones.
        bandwidth, cache, name: as for :class:`~privmon.queries.GeneratorQuery`.

    Examples:
        >>> import pandas as pd
        >>> from ctgan import TVAE
        >>> from privmon.queries import SynthesizerQuery
        >>> pool = pd.DataFrame({"x": [0.01 * i for i in range(300)], "c": ["a", "b", "c"] * 100})
        >>> members, reference = pool.iloc[:40], pool.iloc[100:]
        >>> tvae = TVAE(epochs=2, batch_size=20, enable_gpu=False)
        >>> tvae.fit(members, discrete_columns=["c"])
        >>> query = SynthesizerQuery(tvae, reference, n_samples=500)
        >>> query.prepare()  # what the monitor does at each check
        >>> scores = query(members)  # log p_G(x) - log p_R(x) per member
        >>> query.release()
        >>> scores.shape
        torch.Size([40])
    """

    def __init__(
        self,
        synthesizer: Any,
        reference: Any,
        *,
        attack: str = "domias",
        n_samples: int = 10_000,
        categorical: Sequence[str] | None = None,
        bandwidth: str | float = "scott",
        cache: bool = True,
        name: str | None = None,
    ) -> None:
        self.synthesizer = synthesizer_model(synthesizer)
        if not is_table(reference):
            raise TypeError(
                f"reference must be a pandas DataFrame of population records, got "
                f"{type(reference).__name__}"
            )
        super().__init__(
            None,
            reference,
            attack=attack,
            n_samples=n_samples,
            sample_fn=self._sample,
            categorical=categorical,
            bandwidth=bandwidth,
            cache=cache,
            name=name,
        )

    def _sample(self, n: int, device: Any) -> Any:
        return self.synthesizer.sample(n)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.synthesizer.name}, name={self.name!r}, "
            f"attack={self.attack!r})"
        )
