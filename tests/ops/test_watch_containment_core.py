"""The watcher's pure containment core (`r9k.ops.containment`), over any sequence of kernel events:
duplicates (the same record read again after a restart), saved-log record ids and kernel stream
positions, faults and non-faults, and a state dir that stops taking writes and comes back. The
model below stands where the watcher's files are; the decisions are the shipped ones.

What must hold: a record is counted at most once in the store and at most once from memory; a
card is fenced by its first fault and its hooks run once for that, saved or not; a retry that
saves an event contained from memory runs no hooks; non-faults (and a ring timeout the driver
recovered from) never fence; a card fenced when the watcher starts gets no hooks again. Two tests
run the real Watcher around the core, where the held event is retried and the hooks called."""
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
    # the host's events: each record once, by type
    host = {r for r in records if r[0] is HOST}
    assert {t: e["count"] for t, e in watch.host.events.items()} == \
        {t: n for t in EVENT_TYPES if (n := sum(1 for r in host if r[1] == t))}


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


# -- the watcher's glue around the core: a real Watcher over a log file and a real state dir --

def _watcher(tmp_path, hooks):
    from doubles.ops_host import CardSpec, build_host_tree
    from r9k.ops.watch import FileSource, Watcher

    host = build_host_tree(tmp_path / "host", [CardSpec(CARDS[0])])
    log = tmp_path / "kern.log"
    log.write_text("")
    return Watcher(FileSource(log), tmp_path / "state", host_root=host, hooks=hooks,
                   hook_timeout_s=10, on_warning=lambda _: None), log


def _mes(card, t):
    return f"[ {t:7.1f}] amdgpu {card}: amdgpu: MES failed to respond to msg=REMOVE_QUEUE\n"


def test_hooks_run_once_when_the_state_dir_takes_the_fault_only_later(tmp_path, monkeypatch):
    """A fault read while the state dir takes no writes is fenced from memory (hooks run); when
    the dir takes writes again the held event is saved at the next poll, the card file says
    fenced, and the hooks do not run a second time."""
    import errno

    import r9k.ops.state as state_mod
    from r9k.ops.state import read_card_state

    hook = tmp_path / "hook.sh"
    marks = tmp_path / "marks"
    hook.write_text(f'#!/bin/sh\necho "$R9K_BDF" >> {marks}\n')
    hook.chmod(0o755)
    watcher, log = _watcher(tmp_path, [["/bin/sh", str(hook)]])
    real = state_mod.atomic_write_json

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state_mod, "atomic_write_json", full)
    log.write_text(_mes(CARDS[0], 1.0))
    first = watcher.poll()
    assert [(s.new, s.fenced_now, bool(s.unsaved)) for s in first] == [(True, True, True)]
    watcher.wait_for_hooks(10)
    monkeypatch.setattr(state_mod, "atomic_write_json", real)
    with open(log, "a") as fh:
        fh.write("[    2.0] amdgpu 0000:03:00.0: amdgpu: GPU reset begin!\n")
    second = watcher.poll()   # saves the held MES event first, then counts the reset
    assert [(s.event.type, s.new, s.fenced_now) for s in second] == [("reset_begin", True, False)]
    watcher.wait_for_hooks(10)
    state = read_card_state(tmp_path / "state", CARDS[0])
    assert not state.healthy and state.counts["mes_timeout"] == 1 and state.counts["reset_begin"] == 1
    assert marks.read_text().splitlines() == [CARDS[0]]  # once, from memory; not again when saved


def test_without_hooks_a_card_fenced_from_memory_is_fenced_once(tmp_path, monkeypatch):
    """No hooks configured, the state dir full: the first fault fences the card from memory and
    a second fault of the same card does not fence it again."""
    import errno

    import r9k.ops.state as state_mod

    watcher, log = _watcher(tmp_path, [])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state_mod, "atomic_write_json", full)
    log.write_text(_mes(CARDS[0], 1.0) + _mes(CARDS[0], 2.0))
    assert [(s.new, s.fenced_now) for s in watcher.poll()] == [(True, True), (True, False)]


def test_host_events_are_written_when_counted_and_never_for_a_record_seen_before(tmp_path):
    """The storage under the core: `update_host_events` writes host-events.json (and appends a
    saved log's record id to host-events.seen) only when the core counted something; a record
    read again writes nothing, byte for byte."""
    from r9k.ops.state import HOST_SEEN_FILE, host_events_path, read_host_events, update_host_events

    core = Containment(DEFAULT_FAULT_EVENTS, "boot-1")
    state = tmp_path / "state"
    state.mkdir()
    kmsg = _event(HOST, "ring_timeout", ("kmsg:boot-a", 5, None))
    saved_log = _event(HOST, "mes_timeout", ("file:/var/log/kern.log", 1, "id-1"))

    def count(event, now):
        return update_host_events(state, lambda doc: core.count_on_host(doc, event, now))

    assert count(kmsg, 10.0) is True and count(saved_log, 11.0) is True
    written = host_events_path(state).read_bytes()
    seen = (state / HOST_SEEN_FILE).read_bytes()
    assert seen == b"id-1\n"
    mtime = host_events_path(state).stat().st_mtime_ns
    assert count(kmsg, 20.0) is False and count(saved_log, 21.0) is False
    assert host_events_path(state).read_bytes() == written and (state / HOST_SEEN_FILE).read_bytes() == seen
    assert host_events_path(state).stat().st_mtime_ns == mtime
    events = {e.type: e for e in read_host_events(state)}
    assert (events["ring_timeout"].count, events["mes_timeout"].count) == (1, 1)
    assert events["ring_timeout"].first_seen == events["ring_timeout"].last_seen == 10.0
    # a later record on the same stream counts, and moves last_seen only
    assert count(_event(HOST, "ring_timeout", ("kmsg:boot-a", 6, None)), 30.0) is True
    ring = {e.type: e for e in read_host_events(state)}["ring_timeout"]
    assert (ring.count, ring.first_seen, ring.last_seen) == (2, 10.0, 30.0)
