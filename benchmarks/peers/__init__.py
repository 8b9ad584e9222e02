"""Peers for the benchmarks: other systems run in the same process on the same weights (llama.cpp), behind the
calls the engine offers (systems.py), and the workloads run on each (workloads.py)."""
