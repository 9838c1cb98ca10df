"""r9k.monitoring: Prometheus exporter, alert rules, Grafana dashboards."""
