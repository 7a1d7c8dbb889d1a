"""rlbus.models — torch models shared by the reference engine, the demo, the tests and the benches."""
