"""rlbus.sdk — the trainer SDK: RLClient (calls), WeightPush (the trainer side of an update), the version watcher."""
