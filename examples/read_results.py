"""Read a job's results the way a downstream consumer would, with their lineage.

Guarantees: every request id that has a result appears; on Apache Kafka each appears once (results are
produced in the worker's transactions and read here with read_committed). On the embedded broker aborted
transactions stay visible, so this keeps the first copy per id - every copy of an id carries the same output.

    python examples/read_results.py JOB [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import os

from batchline.config import KafkaSettings
from batchline.kafka import headers
from batchline.kafka.scan import scan
from schemas import codec_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--bootstrap", default=os.environ.get("BATCHLINE_BOOTSTRAP", "127.0.0.1:9092"))
    args = parser.parse_args()
    seen: set[str] = set()
    for msg in scan(KafkaSettings(bootstrap=args.bootstrap), f"{args.job}.results"):
        result = codec_for("result").decode(msg.value())
        if result.request_id in seen:
            continue
        seen.add(result.request_id)
        lineage = codec_for("lineage").decode(dict(msg.headers())[headers.LINEAGE])
        answer = result.output if result.output is not None else result.label
        print(
            f"{result.request_id}\t{answer!r}\tmodel={lineage.model_id} fingerprint={lineage.fingerprint} "
            f"run={result.run_id} from={lineage.source_topic}[{lineage.source_partition}]@{lineage.source_offset}"
        )
    print(f"{len(seen)} results")


if __name__ == "__main__":
    main()
