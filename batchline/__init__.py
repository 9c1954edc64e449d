"""batchline: the platform (config, Kafka clients, broker, topics, telemetry) and the CLI."""
