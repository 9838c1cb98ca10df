"""The Grafana dashboards, built with Grafana's own typed builders (grafana-foundation-sdk, the
Grafana 11.6 schema), so a field Grafana does not know cannot be written.

    pip install 'r9700-stack[test]'          # pins grafana-foundation-sdk for Grafana 11.6
    python src/r9k/monitoring/grafana/dashboards.py  # rewrites src/r9k/monitoring/grafana/r9k-*.json

tests/monitoring/test_monitoring_rules.py fails when a committed JSON differs from what this writes.
Not imported by the stack: the JSON files are what Grafana provisions.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, common, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.prometheus import PromQueryFormat
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import (Dashboard, DataSourceRef, GridPos, VariableOption,
                                                     VariableRefresh, VariableSort)

HERE = Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
HOST = 'instance=~"$instance"'
CARD = 'instance=~"$instance",bdf=~"$bdf"'
REPLICA = 'instance=~"$instance",replica=~"$replica"'
PANEL_BUILDERS = {"timeseries": timeseries.Panel, "stat": stat.Panel, "table": table.Panel,
                  "bargauge": bargauge.Panel}


@dataclass
class PanelSpec:
    kind: str                       # timeseries, stat, table, bargauge
    title: str
    grid: tuple[int, int, int, int]  # x, y, w, h
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str | None = None
    description: str | None = None
    no_value: str | None = None     # shown instead of "No data"
    stacked: bool = False
    extra: dict = field(default_factory=dict)


def _variable(name: str, label: str, query: str) -> dashboard.QueryVariable:
    return (dashboard.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query({"query": query, "refId": name}).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True).multi(True).all_value(".*").sort(VariableSort.ALPHABETICAL_ASC)
            .current(VariableOption(selected=True, text="All", value="$__all")))


def _panel(panel_id: int, spec: PanelSpec):
    x, y, w, h = spec.grid
    builder = (PANEL_BUILDERS[spec.kind]().id(panel_id).title(spec.title).datasource(DATASOURCE)
               .grid_pos(GridPos(x=x, y=y, w=w, h=h)))
    for i, (expr, legend) in enumerate(spec.targets):
        query = (prometheus.Dataquery().ref_id(chr(ord("A") + i)).expr(expr)
                 .legend_format(legend).datasource(DATASOURCE))
        if spec.kind == "table":  # one row per series with its labels, not a series picker
            query = query.instant().format(PromQueryFormat.TABLE)
        builder = builder.with_target(query)
    if spec.unit:
        builder = builder.unit(spec.unit)
    if spec.description:
        builder = builder.description(spec.description)
    if spec.no_value is not None:
        builder = builder.no_value(spec.no_value)
    if spec.stacked:
        builder = builder.stacking(common.StackingConfig().mode(StackingMode.NORMAL).group("A"))
    return builder


def build(uid: str, title: str, tags: list[str], variables: list, panels: list[PanelSpec]) -> dict:
    board = (dashboard.Dashboard(title).uid(uid).tags(tags).timezone("browser").editable().refresh("30s")
             .time("now-6h", "now")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    for variable in variables:
        board = board.with_variable(variable)
    for panel_id, spec in enumerate(panels, start=1):
        board = board.with_panel(_panel(panel_id, spec))
    return through_schema(json.loads(json.dumps(board.build(), cls=JSONEncoder)))


def through_schema(data: dict) -> dict:
    """Decode with Grafana's dashboard model (panel options and field config by panel plugin) and
    encode again: what the schema does not know is dropped, so a dashboard equal to its own
    round trip has no unknown or misplaced field."""
    register_default_plugins()
    return json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))


def power_thermals() -> dict:
    t = "timeseries"
    return build("r9k-power-thermals", "R9700 fleet: power and thermals", ["r9k", "power"], [
        _variable("instance", "Host", "label_values(r9k_gpu_info, instance)"),
        _variable("bdf", "Card", 'label_values(r9k_gpu_info{instance=~"$instance"}, bdf)'),
    ], [
        PanelSpec(t, "Power draw vs cap", (0, 0, 12, 8), [
            (f"r9k_gpu_power_watts{{{CARD}}}", "{{instance}} {{bdf}} draw"),
            (f"r9k_gpu_power_cap_watts{{{CARD}}}", "{{instance}} {{bdf}} cap"),
            (f"r9k_gpu_power_cap_wanted_watts{{{CARD}}}", "{{instance}} {{bdf}} wanted")], unit="watt"),
        PanelSpec(t, "Voltage offset: actual vs wanted", (12, 0, 12, 8), [
            (f"r9k_gpu_voltage_offset_volts{{{CARD}}}", "{{instance}} {{bdf}} actual"),
            (f"r9k_gpu_voltage_offset_wanted_volts{{{CARD}}}", "{{instance}} {{bdf}} wanted")], unit="volt"),
        PanelSpec("stat", "Cards with cap/offset drift", (0, 8, 6, 8), [
            (f"sum(r9k_gpu_config_drift{{{CARD}}}) or vector(0)", "drifting cards")], no_value="0",
            description="Cards whose power cap or voltage offset differs from the ops config (alert after "
                        "5 min). Hosts whose ops config is refused report no drift: see the next panel."),
        PanelSpec("stat", "Hosts with ops config refused or missing", (6, 8, 6, 8), [
            (f"count(r9k_ops_config_valid{{{HOST}}} == 0) or vector(0)", "config refused")], no_value="0",
            description="Drift is unknown on these hosts (OpsConfigInvalid)."),
        PanelSpec(t, "Cap headroom", (12, 8, 12, 8), [
            (f"r9k_gpu_power_cap_watts{{{CARD}}} - r9k_gpu_power_watts{{{CARD}}}", "{{instance}} {{bdf}}")],
            unit="watt"),
        PanelSpec(t, "Junction temperature", (0, 16, 12, 8), [
            (f'r9k_gpu_temperature_celsius{{{CARD},sensor="junction"}}', "{{instance}} {{bdf}}")], unit="celsius"),
        PanelSpec(t, "Edge and memory temperature", (12, 16, 12, 8), [
            (f'r9k_gpu_temperature_celsius{{{CARD},sensor=~"edge|mem"}}', "{{instance}} {{bdf}} {{sensor}}")],
            unit="celsius"),
        PanelSpec(t, "VRAM used", (0, 24, 12, 8), [
            (f"r9k_gpu_vram_used_bytes{{{CARD}}} / r9k_gpu_vram_total_bytes{{{CARD}}}", "{{instance}} {{bdf}}")],
            unit="percentunit"),
        PanelSpec(t, "GPU busy", (12, 24, 12, 8), [(f"r9k_gpu_busy_ratio{{{CARD}}}", "{{instance}} {{bdf}}")],
                  unit="percentunit"),
        PanelSpec(t, "Clocks", (0, 32, 12, 8), [(f"r9k_gpu_clock_hertz{{{CARD}}}", "{{instance}} {{bdf}} {{clock}}")],
                  unit="hertz"),
        PanelSpec(t, "VDDGFX", (12, 32, 12, 8), [(f"r9k_gpu_vddgfx_volts{{{CARD}}}", "{{instance}} {{bdf}}")],
                  unit="volt"),
    ])


def faults() -> dict:
    return build("r9k-faults", "R9700 fleet: faults and containment", ["r9k", "faults"], [
        _variable("instance", "Host", "label_values(r9k_gpu_expected_cards, instance)"),
        _variable("bdf", "Card", 'label_values(r9k_gpu_info{instance=~"$instance"}, bdf)'),
    ], [
        PanelSpec("stat", "Fenced (unhealthy) cards", (0, 0, 6, 8), [
            (f"sum(r9k_gpu_unhealthy{{{CARD}}}) or vector(0)", "unhealthy")], no_value="0"),
        PanelSpec("stat", "Hosts with GPU recovery on", (6, 0, 6, 8), [
            # `or vector(0)`: 0 when every host has recovery off, not "No data"
            (f"count(r9k_host_gpu_recovery_disabled{{{HOST}}} == 0) or vector(0)", "recovery on")],
            no_value="0", description="amdgpu.gpu_recovery should be 0: a reset attempt can take a card off "
                                      "the bus (GpuRecoveryEnabled)."),
        PanelSpec("stat", "Cards missing (expected - present)", (12, 0, 6, 8), [
            (f"sum(r9k_gpu_expected_cards{{{HOST}}} - r9k_gpu_present_cards{{{HOST}}}) or vector(0)", "missing")],
            no_value="0", description="Cards the ops config expects that are not on the bus (GpuCardMissing)."),
        PanelSpec("stat", "Unattributed faults in range", (18, 0, 6, 8), [
            (f"sum(increase(r9k_host_unattributed_faults_total{{{HOST}}}[$__range])) or vector(0)",
             "unattributed")], no_value="0",
            description="Kernel faults no card could be named for: no card was fenced (GpuUnattributedFault)."),
        PanelSpec("bargauge", "Events in range by type", (0, 8, 12, 8), [
            (f"sum by (event) (increase(r9k_gpu_events_total{{{CARD}}}[$__range]))", "{{event}}")]),
        PanelSpec("table", "Missing cards", (12, 8, 12, 8), [
            (f"r9k_gpu_missing{{{HOST}}} == 1", "{{instance}} {{bdf}}")]),
        PanelSpec("timeseries", "Events per card (1h)", (0, 16, 24, 8), [
            (f"sum by (instance, bdf, event) (increase(r9k_gpu_events_total{{{CARD}}}[1h])) > 0",
             "{{instance}} {{bdf}} {{event}}")]),
        PanelSpec("table", "Event totals per card", (0, 24, 12, 8), [
            (f"r9k_gpu_events_total{{{CARD}}} > 0", "{{instance}} {{bdf}} {{event}}")]),
        PanelSpec("table", "Unhealthy cards", (12, 24, 12, 8), [
            (f"r9k_gpu_unhealthy{{{CARD}}} == 1", "{{instance}} {{bdf}}")]),
        PanelSpec("table", "Firing GPU and exporter alerts", (0, 32, 12, 8), [
            ('ALERTS{alertstate="firing",alertname=~"Gpu.*|Exporter.*|OpsConfig.*"}',
             "{{alertname}} {{instance}} {{bdf}}")]),
        PanelSpec("timeseries", "Exporter scrape errors by source", (12, 32, 12, 8), [
            (f"sum by (instance, source) (increase(r9k_scrape_errors_total{{{HOST}}}[$__rate_interval]))",
             "{{instance}} {{source}}")]),
        PanelSpec("timeseries", "Exporters up", (0, 40, 12, 8), [
            (f'up{{job="r9k-exporter",{HOST}}}', "{{instance}}")]),
        # the MES event log watch (GpuMesLogStalled): what the alert reads, and whether it can
        PanelSpec("timeseries", "MES event log unchanged", (12, 40, 12, 8), [
            (f"r9k_gpu_mes_log_unchanged_seconds{{{CARD}}}", "{{instance}} {{bdf}}")], unit="s",
            description="Seconds since the card's MES event log (debugfs) last changed. GpuMesLogStalled "
                        "fires at 300 s while the card reads at least 50% busy: on gfx1201 MES has gone "
                        "silent like this minutes before a MES timeout and reset."),
        PanelSpec("stat", "Hosts whose exporter cannot read debugfs", (0, 48, 6, 8), [
            (f"count(r9k_host_debugfs_readable{{{HOST}}} == 0) or vector(0)", "unreadable")],
            no_value="0", description="No MES log watch on these hosts: debugfs not mounted, or root-only "
                                      "and the exporter not root (--debugfs)."),
        PanelSpec("table", "MES event log per card (1 = yes)", (6, 48, 18, 8), [
            (f'label_replace(r9k_gpu_mes_log_enabled{{{CARD}}}, "log", "enabled", "", "") or '
             f'label_replace(r9k_gpu_mes_log_readable{{{CARD}}}, "log", "readable", "", "")',
             "{{instance}} {{bdf}} {{log}}")],
            description="enabled 0: amdgpu made no log (amdgpu.mes_log_enable=0), no watch for that card; "
                        "readable 0: the log could not be read or did not parse as amdgpu's hex dump "
                        "(counted as debugfs scrape errors)."),
    ])


def kv_cache() -> dict:
    t = "timeseries"
    return build("r9k-kv-cache", "R9700 fleet: KV cache and pinning per replica", ["r9k", "kv-cache"], [
        _variable("instance", "Exporter", "label_values(r9k_replica_info, instance)"),
        _variable("replica", "Replica", 'label_values(r9k_replica_info{instance=~"$instance"}, replica)'),
    ], [
        PanelSpec(t, "KV pool used", (0, 0, 12, 8), [(f"r9k_kv_usage_ratio{{{REPLICA}}}", "{{replica}}")],
                  unit="percentunit"),
        PanelSpec(t, "Pool pinned by running requests (GDN state pages vs attention)", (12, 0, 12, 8), [
            (f"r9k_kv_pinned_ratio{{{REPLICA}}}", "{{replica}} {{kind}}")], unit="percentunit", stacked=True,
            description="Share of the pool running requests hold before any context (capacity module): "
                        "what one-page pages shrink."),
        PanelSpec("bargauge", "KV capacity by page mode", (0, 8, 12, 8), [
            (f"r9k_kv_capacity_tokens{{{REPLICA}}}", "{{replica}} {{page_mode}}")]),
        PanelSpec("stat", "One-page / stock capacity", (12, 8, 6, 8), [
            (f'r9k_kv_capacity_tokens{{{REPLICA},page_mode="onepage"}} / ignoring(page_mode) '
             f'r9k_kv_capacity_tokens{{{REPLICA},page_mode="stock"}}', "{{replica}}")], unit="percentunit"),
        PanelSpec("stat", "Pool blocks", (18, 8, 6, 8), [(f"r9k_kv_pool_blocks{{{REPLICA}}}", "{{replica}}")]),
        PanelSpec(t, "Requests running and waiting", (0, 16, 12, 8), [
            (f"r9k_replica_requests_running{{{REPLICA}}}", "{{replica}} running"),
            (f"r9k_replica_requests_waiting{{{REPLICA}}}", "{{replica}} waiting"),
            (f"r9k_kv_whole_requests{{{REPLICA}}} and on(replica, page_mode) "
             f"r9k_replica_info{{{REPLICA}}}", "{{replica}} whole requests ({{page_mode}})")],
            description="Whole requests: requests of max_model_len the pool runs at once in the "
                        "page mode the replica runs (capacity module). Running above it, vLLM "
                        "may preempt requests as they grow (fleet max_num_seqs: planner admits no "
                        "more)."),
        PanelSpec(t, "Preemptions", (12, 16, 12, 8), [
            (f"rate(r9k_replica_preemptions_total{{{REPLICA}}}[$__rate_interval])", "{{replica}}")]),
        PanelSpec("table", "Replica state", (0, 24, 8, 8), [
            (f"r9k_replica_state{{{REPLICA}}} == 1", "{{replica}} {{state}}")]),
        PanelSpec("stat", "Replica up", (8, 24, 8, 8), [(f"r9k_replica_up{{{REPLICA}}}", "{{replica}}")]),
        PanelSpec("table", "Page mode and layout", (16, 24, 8, 8), [
            (f"r9k_replica_info{{{REPLICA}}}", "{{replica}} {{page_mode}} tp={{tp}} k={{num_spec}} {{layout_source}}")]),
    ])


def energy() -> dict:
    """What a token costs: the recording rules of src/r9k/monitoring/rules/r9k.energy.rules.yml (card
    energy joined to replicas by the fleet's card map) and each card's draw against its cap."""
    t = "timeseries"
    rep = 'replica=~"$replica"'
    host = 'host=~"$host"'
    return build("r9k-energy", "R9700 fleet: energy per token", ["r9k", "energy"], [
        _variable("replica", "Replica", "label_values(r9k_replica_info, replica)"),
        _variable("host", "Host", "label_values(r9k_gpu_energy_joules_total, host)"),
    ], [
        PanelSpec(t, "Output tokens per joule, per replica", (0, 0, 12, 8), [
            (f"r9k:replica_output_tokens_per_joule:1m{{{rep}}}", "{{replica}}")], unit="short",
            description="Output tokens over the energy of the replica's cards (their energy counters, "
                        "1 m rate). Absent while a replica generates nothing."),
        PanelSpec(t, "Joules per output token: stock vs one-page", (12, 0, 12, 8), [
            ("r9k:page_mode_joules_per_output_token:1m", "{{page_mode}}")], unit="J",
            description="Every replica of a page mode: their cards' energy over their output tokens "
                        "(idle replicas' draw counts against their mode)."),
        PanelSpec(t, "Draw and cap per card", (0, 8, 12, 8), [
            (f"rate(r9k_gpu_energy_joules_total{{{host}}}[$__rate_interval])", "{{host}} {{bdf}} draw"),
            (f"r9k_gpu_power_cap_watts and on (instance, bdf) r9k_gpu_energy_joules_total{{{host}}}",
             "{{instance}} {{bdf}} cap")], unit="watt",
            description="Draw from the energy counter (what was integrated, not one sample)."),
        PanelSpec(t, "Watts per running request", (12, 8, 12, 8), [
            (f"r9k:replica_watts_per_running_request:1m{{{rep}}}", "{{replica}}")], unit="watt",
            description="A replica's draw over the requests it runs: one-page runs more requests in "
                        "the same pool, for about the same card power."),
        PanelSpec(t, "Replica draw", (0, 16, 12, 8), [
            (f"r9k:replica_energy_watts:rate1m{{{rep}}}", "{{replica}}")], unit="watt"),
        PanelSpec("stat", "Energy not integrated in range", (12, 16, 6, 8), [
            (f"sum(increase(r9k_gpu_energy_gap_seconds_total{{{host}}}[$__range])) or vector(0)", "gaps")],
            unit="s", no_value="0",
            description="Seconds no power sample covered (failed or late reads, energy counter "
                        "restarts): joules per token are low by that share."),
        PanelSpec("table", "Energy source per card", (18, 16, 6, 8), [
            (f"r9k_gpu_energy_source_info{{{host}}}", "{{host}} {{bdf}} {{source}}")]),
    ])


DASHBOARDS = {"r9k-power-thermals.json": power_thermals, "r9k-faults.json": faults, "r9k-kv-cache.json": kv_cache,
              "r9k-energy.json": energy}


def render_all() -> dict[str, str]:
    return {name: json.dumps(make(), indent=2, sort_keys=True) + "\n" for name, make in DASHBOARDS.items()}


def main(out_dir: Path = HERE) -> None:
    for name, text in render_all().items():
        (out_dir / name).write_text(text)
        print(f"wrote {out_dir / name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
