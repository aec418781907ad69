"""What the benchmarks share: workloads, arrivals, the timed client, metrics, results folders, reports and
the servers under test."""
