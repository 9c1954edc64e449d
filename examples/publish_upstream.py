"""Publish work to a job as an upstream system would: plain JSON with confluent-kafka, no batchline import.

Guarantees: the producer is idempotent (acks=all), so a retried send never duplicates a record; keys are
request ids, so a request always lands on the same partition. Records without a run id join the job's open
stream; its first worker pins it to its own fingerprint unless `batchline topics create JOB --pin` did.

    python examples/publish_upstream.py JOB [--count N] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import os

from confluent_kafka import Producer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--bootstrap", default=os.environ.get("BATCHLINE_BOOTSTRAP", "127.0.0.1:9092"))
    args = parser.parse_args()
    producer = Producer({"bootstrap.servers": args.bootstrap, "enable.idempotence": True, "acks": "all"})
    for i in range(args.count):
        record = {"id": f"upstream-{i}", "prompt": f"Summarise ticket {i}: my order has not arrived", "value": 1.0}
        producer.produce(f"{args.job}.requests", json.dumps(record).encode(), record["id"].encode())
        producer.poll(0)
    if producer.flush(30):
        raise SystemExit("some records were not delivered")
    print(f"published {args.count} records to {args.job}.requests")


if __name__ == "__main__":
    main()
