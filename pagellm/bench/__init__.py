"""Benchmarks that write JSON and print a table: ``pagellm bench throughput``."""
