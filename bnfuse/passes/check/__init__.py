"""The numerical proof of a rewrite: seeded inputs, engines, tolerances and per-fold probes."""
