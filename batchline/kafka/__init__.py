"""Kafka plumbing: client factory, transactions, scans, topics, headers, the embedded broker."""
