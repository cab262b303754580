"""Cluster simulation: workloads, a cost model, and a discrete-event simulator that drives the real
`tokenspeed.sched` schedulers and `tokenspeed.cache` caches. Run `python -m tokenspeed.sim --help`.
"""
