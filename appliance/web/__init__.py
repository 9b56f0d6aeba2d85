"""HTTP shared by the three programs: listening on both IP families with bounded connections,
the health and readiness probes, and Prometheus metrics."""
