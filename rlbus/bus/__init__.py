"""rlbus.bus — NATS plumbing both wings share: one way to connect, one map from a NATS outcome to an error code."""
