"""The watcher's pure containment core (`r9k.ops.containment`), over any sequence of kernel events:
duplicates (the same record read again after a restart), saved-log record ids and kernel stream
positions, faults and non-faults, and a state dir that stops taking writes and comes back. The
model below stands where the watcher's files are; the decisions are the shipped ones.

What must hold: a record is counted at most once in the store and at most once from memory; a
card is fenced by its first fault and its hooks run once for that, saved or not; a retry that
saves an event contained from memory runs no hooks; non-faults (and a ring timeout the driver
recovered from) never fence; a card fenced when the watcher starts gets no hooks again."""
from __future__ import annotations

import copy

from hypothesis import given, settings, strategies as st

from r9k.ops.containment import Containment, Counted, identity
from r9k.ops.kernlog import KernelEvent
from r9k.ops.state import DEFAULT_FAULT_EVENTS, EVENT_TYPES, CardState, HostEventsDoc

CARDS = ["0000:03:00.0", "0000:04:00.0"]
HOST = None  # an event no card could be named for


def _event(card: str | None, kind: str, record: tuple, soft: bool = False) -> KernelEvent:
    stream, ordinal, record_id = record
    detail = {"soft_recovered": True} if soft else {}
    return KernelEvent(kind, card, f"amdgpu {card}: {kind}", stream, ordinal,
                       "prefix" if card else "none", detail, record_id=record_id)


@st.composite
def steps(draw):
    """Records as a kernel log holds them (each identity one record: its card, type and text),
    read in log order with re-reads of earlier records mixed in (a restart reads again from
    its cursor), each read with whether the state dir takes writes at that moment."""
    specs = draw(st.lists(st.tuples(st.sampled_from(CARDS + [HOST]), st.sampled_from(EVENT_TYPES), st.booleans(),
                                    st.sampled_from(["kmsg", "file"])), min_size=1, max_size=20))
    records, ordinal = [], 0
    for n, (card, kind, soft, source) in enumerate(specs):
        ordinal += 1
        identity_ = ("kmsg:boot-a", ordinal, None) if source == "kmsg" else \
            ("file:/var/log/kern.log", ordinal, f"id-{n}")
        records.append((card, kind, identity_, soft and kind == "ring_timeout"))
    reads = []
    for n, record in enumerate(records):
        for _ in range(draw(st.integers(0, 2))):  # earlier records read again
            reads.append((records[draw(st.integers(0, n))], draw(st.booleans())))
        reads.append((record, draw(st.booleans())))
    return reads


class Watch:
    """The watcher's loop with the files replaced by a dict: the same calls, in the same order."""

    def __init__(self, fenced_at_start=()):
        self.core = Containment(DEFAULT_FAULT_EVENTS, "boot-1", fenced=fenced_at_start)
        self.store = {c: CardState(bdf=c, healthy=c not in fenced_at_start) for c in CARDS}
        self.host = HostEventsDoc(events={}, positions={}, seen_ids=[])
        self.unsaved: list[tuple[KernelEvent, bool]] = []
        self.hooks: list[str] = []
        self.saved_new: list[tuple] = []
        self.memory_new: list[tuple] = []

    def _count(self, event, fault, store_ok, retry=False):
        if event.bdf is None:  # the host's events: counted once, never fenced, no hooks
            if store_ok:
                doc = copy.deepcopy(self.host)
                new = self.core.count_on_host(doc, event, now=1.0)
                self.host = doc
                if new:
                    self.saved_new.append((None, identity(event)))
                return Counted(new=new), True
            new = self.core.first_unsaved(event)
            if new:
                self.memory_new.append((None, identity(event)))
            return Counted(new=new), False
        if store_ok:
            state = copy.deepcopy(self.store[event.bdf])
            counted = self.core.count(state, event, fault, now=1.0)
            self.store[event.bdf] = state  # the atomic write
            if counted.new:
                self.saved_new.append((event.bdf, identity(event)))
        else:
            counted = self.core.count_unsaved(event, fault)
            if counted.new:
                self.memory_new.append((event.bdf, identity(event)))
        if self.core.hooks_due(event, counted, retry=retry):
            self.hooks.append(event.bdf)
        return counted, store_ok

    def step(self, event, store_ok):
        if store_ok:  # each poll first tries again what the store did not take
            left = [(e, f) for e, f in self.unsaved if not self._count(e, f, True, retry=True)[1]]
            self.unsaved = left
        fault = self.core.is_fault(event)
        counted, saved = self._count(event, fault, store_ok)
        if not saved and counted.new:
            self.unsaved.append((event, fault))


@settings(max_examples=300, deadline=None)
@given(steps(), st.sampled_from([(), (CARDS[1],)]))
def test_each_record_counts_once_and_each_card_is_fenced_and_hooked_once(reads, fenced_at_start):
    watch = Watch(fenced_at_start)
    for (card, kind, record, soft), store_ok in reads:
        watch.step(_event(card, kind, record, soft), store_ok)
    watch.step(_event(CARDS[0], "reset_succeeded", ("kmsg:boot-a", 10_000, None)), True)  # store back

    # counted once: in the store, and from memory
    assert len(watch.saved_new) == len(set(watch.saved_new))
    assert len(watch.memory_new) == len(set(watch.memory_new))
    assert not watch.unsaved  # all saved once the store takes writes again
    records = {r for r, _ in reads}
    for card in CARDS:
        state = watch.store[card]
        mine = {r for r in records if r[0] == card}
        # every record read is counted in the store exactly once, by type
        expected = {t: sum(1 for r in mine if r[1] == t) for t in EVENT_TYPES}
        if card == CARDS[0]:
            expected["reset_succeeded"] += 1
        assert state.counts == expected
        faulted = any(kind in DEFAULT_FAULT_EVENTS and not soft for _, kind, _, soft in mine)
        # fenced by its first fault; hooks once for a card a fault fenced, never for a card
        # fenced when the watcher started
        assert state.healthy == (not faulted and card not in fenced_at_start)
        assert watch.hooks.count(card) == (1 if faulted and card not in fenced_at_start else 0), watch.hooks
    # the host's events: each record once, by type; no hooks (no card to fence)
    host = {r for r in records if r[0] is HOST}
    assert {t: e["count"] for t, e in watch.host.events.items()} == \
        {t: n for t in EVENT_TYPES if (n := sum(1 for r in host if r[1] == t))}
    assert None not in watch.hooks


def test_a_soft_recovered_ring_timeout_is_not_a_fault_and_a_hard_one_is():
    core = Containment(DEFAULT_FAULT_EVENTS, "boot-1")
    soft = _event(CARDS[0], "ring_timeout", ("kmsg:b", 1, None), soft=True)
    hard = _event(CARDS[0], "ring_timeout", ("kmsg:b", 2, None))
    assert not core.is_fault(soft) and core.is_fault(hard)
    state = CardState(bdf=CARDS[0])
    assert core.count(state, soft, core.is_fault(soft), 1.0).fenced_now is False and state.healthy
    counted = core.count(state, hard, core.is_fault(hard), 2.0)
    assert counted.new and counted.fenced_now and not state.healthy
    assert state.unhealthy_reason.startswith("ring_timeout: ") and state.unhealthy_boot_id == "boot-1"
    assert state.counts["ring_timeout"] == 2 and state.last_event.time == 2.0


def test_a_fault_saved_after_it_was_contained_from_memory_runs_no_hooks_again():
    core = Containment(DEFAULT_FAULT_EVENTS, "boot-1")
    event = _event(CARDS[0], "mes_timeout", ("kmsg:b", 7, None))
    from_memory = core.count_unsaved(event, True)
    assert from_memory.new and from_memory.fenced_now and core.hooks_due(event, from_memory)
    assert core.count_unsaved(event, True).new is False       # read again: not counted again
    state = CardState(bdf=CARDS[0])
    saved = core.count(state, event, True, 3.0)               # the store takes it now
    assert saved.new and saved.fenced_now and not core.hooks_due(event, saved, retry=True)
    other = _event(CARDS[0], "reset_failed", ("kmsg:b", 8, None))
    again = core.count(state, other, True, 4.0)               # a second fault: already fenced
    assert again.new and not again.fenced_now and not core.hooks_due(event, again)
