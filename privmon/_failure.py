"""Why a part of a check could not be computed, as a value: a check's results carry a
:class:`Failure` in place of that part's figures (a query, a canaries object, a stage on one
rank), so that what failed travels through the check — and between the ranks of a
torch.distributed group — beside what succeeded, never as a bare string."""

from __future__ import annotations

from dataclasses import dataclass

from privmon.estimators.estimates import describe_error

__all__ = ["Failure"]


@dataclass(frozen=True)
class Failure:
    """One part of a check that failed, and why (``reason``: the error's type and message, or
    where it failed; what a report's ``failures`` shows).

    Examples:
        >>> from privmon._failure import Failure
        >>> failed = Failure.of(ZeroDivisionError("division by zero"))
        >>> failed.reason
        'ZeroDivisionError: division by zero'
        >>> failed.on_rank(1).reason  # as the other ranks of a group say it
        'failed on rank 1: ZeroDivisionError: division by zero'
    """

    reason: str

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        """The failure an exception describes: its type and message."""
        return cls(describe_error(error))

    def on_rank(self, rank: int) -> Failure:
        """The same failure as the other ranks of a group see it: naming the rank it came from."""
        return Failure(f"failed on rank {rank}: {self.reason}")
