"""Side-by-side comparison runners for ``kvx bench --compare``.

Each submodule drives another KV-cache transfer library "at its best" on the same workload
kvx benchmarks (permuted paged blocks, prepared descriptors, median of timed iterations) and
returns results in the same JSON shape, so the two can be tabulated together.
Third-party libraries are imported lazily, only inside the processes that need them.
"""
