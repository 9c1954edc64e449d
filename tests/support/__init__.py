"""Test support: reading whole topics, bounded waits, worker processes, job configs. No mocks of Kafka."""
