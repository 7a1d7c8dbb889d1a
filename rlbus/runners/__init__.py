"""rlbus.runners — processes: the CLI, the embedded nats-server, the launcher, serve, nats-config, the demo. The only code that imports the services."""
