"""Dispatch/combine benchmark behind ``uccl-ep bench``: workloads, per-rank runner, report."""
