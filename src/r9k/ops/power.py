"""Power cap and voltage offset: plan (validate against what each card declares), apply through
LACT or sysfs, verify from sysfs, report wanted vs actual, reconcile on drift and after resets.

Public entry points: :func:`power_status`, :func:`apply_power`, :func:`reconcile_once`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from r9k.ops import sysfs
from r9k.ops.config import OpsConfig
from r9k.ops.lact import LactClient, LactError
from r9k.ops.state import CardPresence, StateFileError, card_presence, read_card_states, update_card_state
from r9k.ops.sysfs import Card, NotReady


class BackendError(ValueError):
    """The chosen backend cannot be used (LACT socket absent or answering errors); nothing written."""


@dataclass
class CardPlan:
    bdf: str
    cap_watts: int | None
    offset_mv: int | None


@dataclass
class CardStatus:
    bdf: str
    card: str | None
    is_r9700: bool
    managed: bool
    wanted_cap_watts: int | None
    actual_cap_watts: float | None
    wanted_offset_mv: int | None
    actual_offset_mv: int | None
    cap_range_watts: tuple[float, float] | None
    offset_range_mv: tuple[int, int] | None
    healthy: bool = True
    unhealthy_reason: str | None = None
    fenced: bool = False
    power_watts: float | None = None  # measured draw (power1_average, else power1_input)
    drift: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.drift

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items()}
        data["ok"] = self.ok
        for key in ("cap_range_watts", "offset_range_mv"):
            data[key] = list(data[key]) if data[key] else None
        return data


def _managed_targets(config: OpsConfig, cards: list[Card]) -> list[Card]:
    """R9700s get the defaults; another amdgpu card only when the config names it."""
    return [c for c in cards if c.is_r9700 or c.bdf in config.cards]


def missing_configured_cards(config: OpsConfig, cards: list[Card]) -> list[str]:
    """Cards the config names that are not on the host: reported (drift), never a reason to leave
    the cards that are there unmanaged."""
    present = {c.bdf for c in cards}
    return [bdf for bdf in config.cards if bdf not in present]


def _missing_status(config: OpsConfig, bdf: str) -> "CardStatus":
    wanted = config.wanted(bdf)
    return CardStatus(bdf, None, False, True, wanted.power_cap_watts, None, wanted.voltage_offset_mv, None,
                      None, None, drift=["card not found on this host"])


def plan_card(config: OpsConfig, card: Card) -> tuple[CardPlan, list[str]]:
    """Wanted settings for one card: each setting the card declares valid, and a problem (naming
    the card and its declared range) for each it does not. Nothing outside a declared range is
    ever planned, so never written."""
    wanted = config.wanted(card.bdf)
    cap, offset = wanted.power_cap_watts, wanted.voltage_offset_mv
    problems = []
    if cap is not None:
        if card.cap_min_watts is None or card.cap_max_watts is None:
            problems.append(f"{card.bdf}: power_cap_watts {cap} not settable: the card declares no power cap "
                            "range (power1_cap_min/max missing); its other settings are applied")
            cap = None
        elif not card.cap_min_watts <= cap <= card.cap_max_watts:
            problems.append(
                f"{card.bdf}: power_cap_watts {cap} is outside the card's range "
                f"{card.cap_min_watts:g}-{card.cap_max_watts:g} W"
            )
            cap = None
    if offset is not None:
        rng = card.offset_range_mv
        if rng is None:
            problems.append(
                f"{card.bdf}: voltage_offset_mv {offset} asked but the card declares no VDDGFX_OFFSET range "
                "(overdrive off? amdgpu.ppfeaturemask needs bit 0x4000)"
            )
            offset = None
        elif not rng[0] <= offset <= rng[1]:
            problems.append(
                f"{card.bdf}: voltage_offset_mv {offset} is outside the card's range {rng[0]}..{rng[1]} mV"
            )
            offset = None
    return CardPlan(card.bdf, cap, offset), problems


def _matches(card: Card, plan: CardPlan) -> list[str]:
    drift = []
    if plan.cap_watts is not None:
        if card.cap_watts is None:
            drift.append("power cap unreadable")
        elif round(card.cap_watts * 1_000_000) != plan.cap_watts * 1_000_000:
            drift.append(f"power cap {card.cap_watts:g} W, wanted {plan.cap_watts} W")
    if plan.offset_mv is not None:
        if card.offset_mv is None:
            drift.append("voltage offset unreadable")
        elif card.offset_mv != plan.offset_mv:
            drift.append(f"voltage offset {card.offset_mv} mV, wanted {plan.offset_mv} mV")
    return drift


OVER_CAP_PREFIX = "drew "


def over_cap_drift(config: OpsConfig, status: "CardStatus", since: float | None, now: float) -> str | None:
    """The one over-cap drift every reader shows (reconcile's text and --json, the state file,
    `ops status`, the exporter): a card whose cap reads back right but that has drawn more than
    cap + ``cap_draw_margin_watts`` since ``since`` (unix time, kept in its state file by
    reconcile) for at least ``cap_draw_window_s`` (LACT issue 506). None otherwise."""
    if since is None or not _drawing_over_cap(config, status):
        return None
    if now - since < config.cap_draw_window_s:
        return None
    return (f"{OVER_CAP_PREFIX}{status.power_watts:g} W, over its {status.wanted_cap_watts} W cap by more than "
            f"{config.cap_draw_margin_watts} W for {config.cap_draw_window_s:g} s")


def _drawing_over_cap(config: OpsConfig, status: "CardStatus") -> bool:
    """Drawing more than cap + margin now, with nothing else wrong (a cap that reads back wrong is
    drift of its own, and a fenced or absent card is not judged)."""
    cap = status.wanted_cap_watts
    if cap is None or status.power_watts is None or status.fenced or status.card is None:
        return False
    if any(not d.startswith(OVER_CAP_PREFIX) for d in status.drift):
        return False
    return status.power_watts > cap + config.cap_draw_margin_watts


def _settle(card: Card, plan: CardPlan, timeout_s: float) -> tuple[Card, list[str]]:
    """Read back until the card shows the plan or ``timeout_s`` passes (hwmon may lag a write)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        try:
            card = sysfs.refresh(card)
            drift = _matches(card, plan)
        except NotReady as exc:
            drift = [f"not readable: {exc}"]
        if not drift or time.monotonic() >= deadline:
            return card, drift
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def retry_not_ready(action: Callable[[], Any], deadline: float, sleep: Callable[[float], None] = time.sleep) -> Any:
    """Run ``action`` until it stops raising NotReady or ``deadline`` (monotonic) passes."""
    delay = 0.05
    while True:
        try:
            return action()
        except NotReady:
            if time.monotonic() + delay > deadline:
                raise
            sleep(delay)
            delay = min(delay * 2, 2.0)


def _fenced_bdfs(state_dir: str | os.PathLike | None, host_root: str | os.PathLike) -> dict[str, str]:
    """Cards whose sysfs is not to be touched: faulted this boot, or state unreadable (fail closed:
    the lost file may have said the card was fenced; ``r9k ops clear`` resolves it)."""
    if state_dir is None:
        return {}
    boot = sysfs.boot_id(host_root)
    states = read_card_states(state_dir)
    fenced = {bdf: st.unhealthy_reason or "unhealthy" for bdf, st in states.items() if st.sysfs_fenced(boot)}
    fenced.update({bdf: f"ops state file unreadable ({why}); see r9k ops clear"
                   for bdf, why in states.corrupt.items()})
    return fenced


_KEEP = object()


def _record_power(state_dir: str | os.PathLike | None, statuses: list[CardStatus],
                  over_cap_since: dict[str, float | None] | None = None) -> None:
    """Save each checked card's result (``power_ok``, the same drift list the caller shows) and,
    from reconcile, since when it draws over its cap."""
    if state_dir is None:
        return
    for status in statuses:
        if not status.managed or status.fenced:
            continue
        since = (over_cap_since or {}).get(status.bdf, _KEEP)

        def change(state, status=status, since=since):
            state.power_ok = status.ok
            state.power_drift = list(status.drift)
            state.power_checked_at = time.time()
            if since is not _KEEP:
                state.over_cap_since = since

        try:
            update_card_state(state_dir, status.bdf, change)
        except StateFileError:
            continue  # left for the operator (reported as fenced); a power check must not erase it
        except OSError as exc:  # full or read-only: the check stands, its record is missing
            status.errors.append(f"power check not saved to {state_dir}: {exc.strerror or exc}")


def power_status(
    config: OpsConfig,
    host_root: str | os.PathLike = "/",
    state_dir: str | os.PathLike | None = None,
    record: bool = False,
    over_cap_since: dict[str, float] | None = None,
) -> list[CardStatus]:
    """Wanted vs actual for every amdgpu card (read-only unless ``record`` writes the state dir).
    Over-cap drift is judged from ``over_cap_since`` (reconcile's memory without a state dir),
    else from each card's state file."""
    cards = sysfs.discover_cards(host_root)
    states = read_card_states(state_dir) if state_dir else {}
    fenced = _fenced_bdfs(state_dir, host_root)
    targets = {c.bdf for c in _managed_targets(config, cards)}
    unreadable = getattr(states, "corrupt", {})
    out = []
    for card in cards:
        wanted = config.wanted(card.bdf) if card.bdf in targets else None
        st = states.get(card.bdf)
        status = CardStatus(
            bdf=card.bdf,
            card=card.card_name,
            is_r9700=card.is_r9700,
            managed=wanted is not None,
            wanted_cap_watts=wanted.power_cap_watts if wanted else None,
            actual_cap_watts=card.cap_watts,
            wanted_offset_mv=wanted.voltage_offset_mv if wanted else None,
            actual_offset_mv=card.offset_mv,
            cap_range_watts=(card.cap_min_watts, card.cap_max_watts)
            if card.cap_min_watts is not None and card.cap_max_watts is not None else None,
            offset_range_mv=card.offset_range_mv,
            healthy=st.healthy if st else card.bdf not in unreadable,
            unhealthy_reason=st.unhealthy_reason if st else fenced.get(card.bdf),
            fenced=card.bdf in fenced,
            power_watts=card.power_watts,
            errors=list(card.errors),
        )
        if wanted is not None and not status.fenced:
            status.drift = _matches(card, CardPlan(card.bdf, wanted.power_cap_watts, wanted.voltage_offset_mv))
            since = (over_cap_since.get(card.bdf) if over_cap_since is not None
                     else st.over_cap_since if st else None)
            over = over_cap_drift(config, status, since, time.time())
            if over:
                status.drift.append(over)
        elif status.fenced:
            status.drift = [f"fenced (not touched): {status.unhealthy_reason}"]
        out.append(status)
    out.extend(_missing_status(config, bdf) for bdf in missing_configured_cards(config, cards))
    if record:
        _record_power(state_dir, out)
    return out


@dataclass
class Backend:
    name: str  # "lact" or "sysfs"
    reason: str
    client: LactClient | None = None
    gpu_ids: dict[str, str] = field(default_factory=dict)
    auto: bool = False  # chosen by `backend: auto`: a card LACT does not list goes through sysfs


def choose_backend(config: OpsConfig, override: str | None = None) -> Backend:
    """auto: LACT when its socket answers, else sysfs (and say why). Raises BackendError."""
    wanted = override or config.backend
    if wanted == "sysfs":
        return Backend("sysfs", "configured")
    client = LactClient(config.lact_socket)
    try:
        client.request("ping")
        gpu_ids = client.gpu_ids_by_bdf()
        if gpu_ids:  # the call every apply starts with: an older lactd answers "unknown variant"
            client.get_gpu_config(next(iter(gpu_ids.values())))
    except LactError as exc:
        if wanted == "lact":
            raise BackendError(f"backend lact: {exc}") from None
        return Backend("sysfs", f"LACT not available ({exc})")
    return Backend("lact", "configured" if wanted == "lact" else f"LACT answers on {config.lact_socket}",
                   client, gpu_ids, auto=wanted == "auto")


def _apply_sysfs(card: Card, plan: CardPlan, deadline: float, actions: list[str],
                 force_cap: bool = False) -> Card:
    def attempt() -> Card:
        fresh = sysfs.refresh(card)
        sysfs.check_ready(fresh)
        if plan.cap_watts is not None and (force_cap or fresh.cap_watts != plan.cap_watts):
            sysfs.write_cap_watts(fresh, plan.cap_watts)
            actions.append(f"sysfs power1_cap={plan.cap_watts * 1_000_000}")
        if plan.offset_mv is not None and fresh.offset_mv != plan.offset_mv:
            sysfs.write_offset_mv(fresh, plan.offset_mv)
            actions.append(f"sysfs pp_od_clk_voltage 'vo {plan.offset_mv}' + 'c'")
        return fresh

    return retry_not_ready(attempt, deadline)


def _apply_lact(backend: Backend, card: Card, plan: CardPlan, settle_s: float, actions: list[str]) -> list[str]:
    """Config round trip: set, read the card back, confirm only when it shows the plan, else revert."""
    assert backend.client is not None
    gpu_id = backend.gpu_ids[card.bdf]
    config = backend.client.get_gpu_config(gpu_id)
    if plan.cap_watts is not None:
        config["power_cap"] = float(plan.cap_watts)
    if plan.offset_mv is not None:
        config["voltage_offset"] = plan.offset_mv
    timer = backend.client.set_gpu_config(gpu_id, config)
    actions.append(f"lact set_gpu_config power_cap={config.get('power_cap')} voltage_offset={config.get('voltage_offset')}")
    # Read back well inside the daemon's revert window.
    window = float(timer) / 2 if isinstance(timer, (int, float)) and timer > 0 else 2.5
    _, drift = _settle(card, plan, min(settle_s, window))
    if drift:
        backend.client.revert()
        actions.append("lact revert (card did not show the wanted settings)")
    else:
        backend.client.confirm()
        actions.append("lact confirm")
    return drift


def presence_of(config: OpsConfig, statuses: list[CardStatus]) -> CardPresence:
    """Expected vs present cards from a status list (a status with ``card`` None is not there)."""
    return card_presence(config, [s.bdf for s in statuses if s.card is not None])


@dataclass
class ApplyReport:
    backend: str
    backend_reason: str
    cards: list[CardStatus]
    recovery: sysfs.RecoveryStatus
    presence: CardPresence | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cards if c.managed) and (self.presence is None or self.presence.ok)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "backend": self.backend, "backend_reason": self.backend_reason,
                "recovery": self.recovery.to_json(), "cards": [c.to_json() for c in self.cards]}


def apply_power(
    config: OpsConfig,
    host_root: str | os.PathLike = "/",
    state_dir: str | os.PathLike | None = None,
    backend_override: str | None = None,
    wait_s: float = 30.0,
    settle_s: float = 2.0,
    only: set[str] | None = None,
    force_cap: set[str] | None = None,
) -> ApplyReport:
    """Apply the wanted settings to every managed card (or ``only`` those), then verify from sysfs.

    Raises BackendError before writing anything when the backend cannot be used; a setting a
    card does not declare valid is that card's drift ("refused: ..."), not an error for all.
    """
    deadline = time.monotonic() + wait_s
    cards = sysfs.discover_cards(host_root)
    missing = missing_configured_cards(config, cards)
    targets = [c for c in _managed_targets(config, cards) if only is None or c.bdf in only]
    fenced = _fenced_bdfs(state_dir, host_root)
    backend = choose_backend(config, backend_override)
    not_listed = [c.bdf for c in targets if backend.name == "lact" and c.bdf not in backend.gpu_ids]
    via_sysfs: set[str] = set()
    unlisted: dict[str, str] = {}
    if backend.auto and not_listed:
        # auto: LACT for the cards it lists, sysfs for the others (another GPU's LACT, a card
        # it has not picked up); with none listed, sysfs for all
        if len(not_listed) == len(targets):
            backend = Backend("sysfs", f"LACT answers on {config.lact_socket} but lists none of these "
                                       f"cards ({', '.join(not_listed)}): sysfs")
        else:
            via_sysfs = set(not_listed)
            backend.reason += f"; sysfs for {', '.join(not_listed)} (LACT does not list them)"
    else:
        # explicitly lact: a card LACT does not list is reported for itself; the others applied
        unlisted = {bdf: "LACT does not list this card (list_devices)" for bdf in not_listed}

    # Wait for every card to be readable (hwmon appears late at boot), then validate all of them
    # before the first write: bad input must change nothing.
    ready: dict[str, Card] = {}
    not_ready: dict[str, str] = {}
    for card in targets:
        if card.bdf in fenced or card.bdf in unlisted:
            continue
        wants_cap = config.wanted(card.bdf).power_cap_watts is not None
        try:
            ready[card.bdf] = retry_not_ready(lambda c=card: _checked(c, wants_cap), deadline)
        except NotReady as exc:
            not_ready[card.bdf] = str(exc)
    # A setting a card does not declare valid is refused for that card alone (reported as its
    # drift); every other card, and that card's valid settings, are still applied.
    plans: dict[str, CardPlan] = {}
    refused: dict[str, list[str]] = {}
    for bdf, card in ready.items():
        plans[bdf], refused[bdf] = plan_card(config, card)

    actions: dict[str, list[str]] = {bdf: [] for bdf in plans}
    for bdf in via_sysfs & set(actions):
        actions[bdf].append("backend sysfs: LACT does not list this card (list_devices)")
    errors: dict[str, str] = {**not_ready, **unlisted}
    for bdf, plan in plans.items():
        if plan.cap_watts is None and plan.offset_mv is None:
            continue
        try:
            if backend.name == "lact" and bdf not in via_sysfs:
                _apply_lact(backend, ready[bdf], plan, settle_s, actions[bdf])
            else:
                _apply_sysfs(ready[bdf], plan, deadline, actions[bdf], bdf in (force_cap or ()))
        except (NotReady, LactError, OSError) as exc:
            errors[bdf] = str(exc)

    # Verify every card from sysfs, whatever the backend said.
    statuses = []
    for card in targets:
        plan = plans.get(card.bdf) or CardPlan(card.bdf, config.wanted(card.bdf).power_cap_watts,
                                               config.wanted(card.bdf).voltage_offset_mv)
        fresh, drift = (_settle(card, plan, settle_s) if card.bdf in plans else (card, []))
        if card.bdf in fenced:
            drift = [f"fenced (not touched): {fenced[card.bdf]}"]
        if card.bdf in errors:
            drift = [f"not applied: {errors[card.bdf]}"] + drift
        drift = [f"refused: {why}" for why in refused.get(card.bdf, [])] + drift
        statuses.append(CardStatus(
            bdf=card.bdf, card=card.card_name, is_r9700=card.is_r9700, managed=True,
            wanted_cap_watts=plan.cap_watts, actual_cap_watts=fresh.cap_watts,
            wanted_offset_mv=plan.offset_mv, actual_offset_mv=fresh.offset_mv,
            cap_range_watts=(fresh.cap_min_watts, fresh.cap_max_watts)
            if fresh.cap_min_watts is not None and fresh.cap_max_watts is not None else None,
            offset_range_mv=fresh.offset_range_mv, fenced=card.bdf in fenced,
            drift=drift, errors=list(fresh.errors), actions=actions.get(card.bdf, []),
        ))
    if only is None:
        statuses.extend(_missing_status(config, bdf) for bdf in missing)
    _record_power(state_dir, statuses)
    return ApplyReport(backend.name, backend.reason, statuses, sysfs.recovery_status(host_root),
                       card_presence(config, [c.bdf for c in cards]))


def _checked(card: Card, wants_cap: bool = True) -> Card:
    fresh = sysfs.refresh(card)
    sysfs.check_ready(fresh)
    if wants_cap and (fresh.cap_min_watts is None or fresh.cap_max_watts is None):
        assert fresh.hwmon_dir is not None  # check_ready
        # files there but unreadable (in reset): wait; a card that has none never will
        if all((fresh.hwmon_dir / name).exists() for name in ("power1_cap_min", "power1_cap_max")):
            raise NotReady("power cap range not readable yet")
    return fresh


@dataclass
class ReconcileState:
    """What the loop remembers between rounds: reset counts seen per card, and (without a state
    dir, which otherwise keeps it) since when each card has drawn more than its cap + margin."""

    resets_seen: dict[str, int] = field(default_factory=dict)
    over_cap_since: dict[str, float] = field(default_factory=dict)


def reconcile_once(
    config: OpsConfig,
    host_root: str | os.PathLike = "/",
    state_dir: str | os.PathLike | None = None,
    memory: ReconcileState | None = None,
    backend_override: str | None = None,
    settle_s: float = 2.0,
) -> tuple[list[CardStatus], list[str]]:
    """Re-verify; re-apply to cards that drifted or were reset since last round.

    Returns (statuses after the round, BDFs re-applied).
    """
    memory = memory or ReconcileState()
    statuses = power_status(config, host_root, state_dir,
                            over_cap_since=memory.over_cap_since if state_dir is None else None)
    states = read_card_states(state_dir) if state_dir else {}
    now = time.time()
    # since when each card draws over its cap: started, kept or ended this round
    since: dict[str, float | None] = {}
    for status in statuses:
        if status.managed and status.card is not None and not status.fenced:
            before = (memory.over_cap_since.get(status.bdf) if state_dir is None else
                      states[status.bdf].over_cap_since if status.bdf in states else None)
            since[status.bdf] = (before or now) if _drawing_over_cap(config, status) else None
    if state_dir is None:
        memory.over_cap_since = {b: t for b, t in since.items() if t is not None}
    redo, force = set(), set()
    for status in statuses:
        if not status.managed or status.fenced or status.card is None:
            continue
        resets = 0
        if status.bdf in states:
            counts = states[status.bdf].counts
            resets = counts.get("reset_succeeded", 0) + counts.get("reset_begin", 0)
        reset_since = resets > memory.resets_seen.get(status.bdf, resets)
        memory.resets_seen[status.bdf] = resets
        if any(d.startswith(OVER_CAP_PREFIX) for d in status.drift):
            force.add(status.bdf)
        if status.drift or reset_since or status.bdf in force:
            redo.add(status.bdf)
    if redo:
        try:
            report = apply_power(config, host_root, state_dir, backend_override, wait_s=settle_s,
                                 settle_s=settle_s, only=redo, force_cap=force)
        except BackendError as exc:  # lactd down for now: this round's drift, the next tries again
            for status in statuses:
                if status.bdf in redo:
                    status.drift = [f"not re-applied: {exc}"] + (status.drift or ["reset since last round"])
            _record_power(state_dir, statuses, since)
            return statuses, []
        after = {c.bdf: c for c in report.cards}
        merged = []
        for status in statuses:
            if status.bdf not in redo:
                merged.append(status)
            elif status.bdf not in after:  # it left the bus between the check and the re-apply
                status.drift = ["not re-applied: card not found on this host (left the bus?)"] + status.drift
                merged.append(status)
            else:
                fresh = after[status.bdf]
                fresh.power_watts, fresh.healthy = status.power_watts, status.healthy
                fresh.unhealthy_reason = status.unhealthy_reason
                # what made the round write the cap again stays this round's drift
                fresh.drift = [f"{d}: cap written again" for d in status.drift
                               if d.startswith(OVER_CAP_PREFIX)] + fresh.drift
                merged.append(fresh)
        statuses = merged
    # one record per round, of the very drift the caller prints
    _record_power(state_dir, statuses, since)
    return statuses, sorted(redo)
