"""Fair admission: a request's choices share a bounded, fair part of the batch.

A request with ``n`` choices is ``n`` engine sequences of one group (the API request id). Without a bound, one
``n: 16`` request took all 16 batch slots and another client's 8-token request waited 136 s for its first token.
Here a group runs at most its fair share of the batch at a time: `max_seqs_per_request`, and no more than an
equal split of the batch between the groups present (running or waiting). The scheduler passes over the waiting
sequences of a group at its share and admits the next request's instead; and when the batch is full while a
request waits within its share, it preempts one sequence of the group furthest over its share per step
(`victim`; recomputed later, as any preempted sequence), so a small request behind large ones starts within a
few steps rather than when they finish.
"""

from __future__ import annotations

from collections.abc import Iterable

from freetoken.engine.sequence import Sequence


def default_share(max_num_seqs: int) -> int:
    """The cap when `--max-seqs-per-request` is 0: the whole batch. Alone, a request may use every slot (no idle
    slots while others could run); beside others, `Admission.fair_share` splits the batch between them."""
    return max(1, max_num_seqs)


class Admission:
    """Which group each sequence belongs to, a group's fair share of the batch, and whom to preempt for it.

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

    def fair_share(self, waiting: Iterable[Sequence], running: Iterable[Sequence], max_num_seqs: int) -> int:
        """Most sequences one group may run now: `max_seqs_per_request`, and at most an equal split of the batch
        between the groups present (at least 1)."""
        groups = {self.group_of(s) for s in running} | {self.group_of(s) for s in waiting}
        return max(1, min(self.max_seqs_per_request, max_num_seqs // max(1, len(groups))))

    def admissible(self, seq: Sequence, running: Iterable[Sequence], share: int) -> bool:
        """Whether `seq` may join the batch: its group runs fewer than `share` (`fair_share`)."""
        group = self.group_of(seq)
        return sum(1 for s in running if self.group_of(s) == group) < share

    def victim(self, waiting: Iterable[Sequence], running: list[Sequence], share: int) -> Sequence | None:
        """The sequence to preempt so that a waiting one within its share gets a batch slot: the newest of the
        group that runs the most sequences past `share`; None when no waiting sequence is admissible or no
        group is over its share."""
        if not any(self.admissible(seq, running, share) for seq in waiting):
            return None
        counts: dict[str, int] = {}
        for seq in running:
            counts[self.group_of(seq)] = counts.get(self.group_of(seq), 0) + 1
        group, count = max(counts.items(), key=lambda item: item[1], default=(None, 0))
        if count <= share:
            return None
        return max((s for s in running if self.group_of(s) == group), key=lambda s: s.arrival)
