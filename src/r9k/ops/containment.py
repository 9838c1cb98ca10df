"""Containment as a pure core: a classified kernel event and what is known in, decisions out.

No files, threads or clock: the watcher (`r9k.ops.watch`) reads the log, hands each event here
with the card's stored state (read under the state-dir lock) and ``now``, writes what comes back,
and runs the hooks when told. Every "seen before" question is answered here, in one of two
places: the stored identities of the card or, for an event no card could be named for, of the
host (`CardState.seen`, `HostEventsDoc.seen`: kernel stream positions and saved-log record ids),
or, while the state dir takes no writes, this object's memory of the records it counted and the
cards it fenced without saving them.

A card is fenced (marked unhealthy) by its first fault while healthy; the hooks run once for that
change, whether it was saved or contained from memory, and never again for the same change when
the state dir takes the event later.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from r9k.ops.kernlog import KernelEvent
from r9k.ops.state import CardState, HostEventsDoc, LastEvent, cap_message


@dataclass(frozen=True)
class Counted:
    """What one event did: counted now (``new``) and the card fenced by it (``fenced_now``)."""

    new: bool
    fenced_now: bool = False


def identity(event: KernelEvent) -> tuple[str, int, str | None]:
    """A record's identity: its kernel stream and position, or its saved log's record id."""
    return event.stream, event.ordinal, event.record_id


class Containment:
    """The watcher's decisions for one host boot. ``fenced``: cards the stored state says are
    unhealthy when the watcher starts (their hooks ran then)."""

    def __init__(self, fault_events: Collection[str], boot_id: str | None,
                 fenced: Collection[str] = ()) -> None:
        self.fault_events = frozenset(fault_events)
        self.boot_id = boot_id
        self._fenced = set(fenced)  # cards whose hooks ran (or ran before the watcher started)
        self._counted_unsaved: set[tuple[str, int, str | None]] = set()

    def is_fault(self, event: KernelEvent) -> bool:
        # a ring timeout the driver recovered from by itself (soft recovery) left the card working
        if event.type == "ring_timeout" and event.detail.get("soft_recovered"):
            return False
        return event.type in self.fault_events

    def count(self, state: CardState, event: KernelEvent, fault: bool, now: float) -> Counted:
        """Apply ``event`` to the card's stored ``state`` (changed in place; the caller writes
        it): counted once by its identity, the last event kept, fenced by a fault while healthy.
        A fault on a card already fenced moves the fence to this boot (sysfs stays untouched)."""
        if state.seen(*identity(event)):
            return Counted(new=False)
        message = cap_message(event.message)
        state.counts[event.type] = state.counts.get(event.type, 0) + 1
        state.last_event = LastEvent(event.type, message, now, dict(event.detail))
        state.mark_seen(*identity(event))
        if not fault:
            return Counted(new=True)
        fenced_now = bool(state.healthy)
        if fenced_now:
            state.healthy = False
            state.unhealthy_reason = f"{event.type}: {message}"
            state.unhealthy_since = now
        state.unhealthy_boot_id = self.boot_id
        return Counted(new=True, fenced_now=fenced_now)

    def count_on_host(self, doc: HostEventsDoc, event: KernelEvent, now: float) -> bool:
        """Apply an event no card could be named for to the host's stored events (changed in
        place; the caller writes it): counted once by its identity, by type, the latest message
        kept. True when counted now. A host event fences nothing: there is no card to fence."""
        if doc.seen(*identity(event)):
            return False
        doc.mark_seen(*identity(event))
        current = doc.events.get(event.type)
        if current is None:
            current = {"type": event.type, "message": "", "first_seen": now, "count": 0}
        current.update(message=cap_message(event.message), count=int(current["count"]) + 1, last_seen=now)
        doc.events[event.type] = current
        return True

    def count_unsaved(self, event: KernelEvent, fault: bool) -> Counted:
        """The state dir did not take ``event``: count and fence from memory, each record once
        and each card once."""
        key = identity(event)
        new = key not in self._counted_unsaved
        self._counted_unsaved.add(key)
        fenced_now = fault and new and event.bdf is not None and event.bdf not in self._fenced
        return Counted(new=new, fenced_now=fenced_now)

    def first_unsaved(self, event: KernelEvent) -> bool:
        """A host event the state dir did not take: new unless counted from memory before."""
        return self.count_unsaved(event, fault=False).new

    def hooks_due(self, event: KernelEvent, counted: Counted, retry: bool = False) -> bool:
        """Whether the hooks run for this outcome: the card was fenced now, and this is not a
        saved retry of an event already contained from memory (its hooks ran then). A yes is
        remembered: the card is fenced for `count_unsaved` from then on."""
        if not counted.fenced_now or retry or event.bdf is None:
            return False
        self._fenced.add(event.bdf)
        return True
