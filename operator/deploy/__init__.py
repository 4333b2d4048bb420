"""Generated deployment artifacts: the RBAC rules the chart grants and the Grafana dashboards and alert rules."""
