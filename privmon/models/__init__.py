"""Models privmon builds from the caller's: k trained models of one architecture as one
:class:`Ensemble`, their parameters stacked (``torch.func.stack_module_state``) and run
together. Queries and audits both use it; it imports no other privmon layer (argument checks
aside)."""

from privmon.models.ensemble import Ensemble

__all__ = ["Ensemble"]
