"""trillm.bench: benchmarks and developer tools (`trillm bench ...`, `trillm simulate`).

Owns: the benchmark suite (serving, peers, engine, kernels, overhead, profile, mock parity), its workloads,
clients, metrics and reports, and the simulator that replays traces on the mock engine in virtual time. May
import everything else in trillm.
"""
