"""Workloads: trace loaders and synthetic generators."""
