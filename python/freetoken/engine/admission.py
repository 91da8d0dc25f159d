"""Fair admission: a request's choices share a bounded part of the batch.

A request with ``n`` choices is ``n`` engine sequences of one group (the API request id). Without a bound, one
``n: 16`` request took all 16 batch slots and another client's 8-token request waited 136 s for its first token.
Here a group runs at most `max_seqs_per_request` sequences at a time; the scheduler skips the waiting sequences
of a group at its share and admits the next request's instead, so a small request behind a large one starts
at the next step (`Scheduler` asks `admissible` for each waiting sequence, in arrival order).
"""

from __future__ import annotations

from collections.abc import Iterable

from freetoken.engine.sequence import Sequence


def default_share(max_num_seqs: int) -> int:
    """The share when `--max-seqs-per-request` is 0: half the batch (at least 1), so one request never holds
    the whole batch, and an ``n`` of up to half the batch still runs all its choices at once."""
    return max(1, max_num_seqs // 2)


class Admission:
    """Which group each sequence belongs to, and whether a group is at its share of the batch.

    Args:
        max_seqs_per_request: most sequences of one group running at once (>= 1).
    """

    def __init__(self, max_seqs_per_request: int) -> None:
        self.max_seqs_per_request = max(1, max_seqs_per_request)
        self._groups: dict[str, str] = {}  # request id -> group, for sequences given a group

    def set_group(self, request_id: str, group: str | None) -> None:
        """Put `request_id` in `group` (None: a group of its own)."""
        if group is not None and group != request_id:
            self._groups[request_id] = group

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted sequence's group entry."""
        self._groups.pop(request_id, None)

    def group_of(self, seq: Sequence) -> str:
        """The group of `seq` (its own request id unless `set_group` said otherwise)."""
        return self._groups.get(seq.request_id, seq.request_id)

    def admissible(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """Whether `seq` may join the batch: its group runs fewer than its share."""
        if seq.request_id not in self._groups:
            return True  # a group of one is always within its share
        group = self._groups[seq.request_id]
        return sum(1 for s in running if self.group_of(s) == group) < self.max_seqs_per_request
