"""Read a job's results the way a downstream consumer would, with their lineage.

One line per result: the answer (the output, or the label), then, where the record asked for them, every choice
(``n``) with its finish reason, the tool calls the model made, how many tokens carry logprobs and the most likely
alternative of the first, and the shape of the embeddings of a record with several inputs.

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
from schemas import Result, codec_for


def extras(result: Result) -> str:
    """The fields beyond the one answer, as ``key=value`` words (empty for a plain result)."""
    words = []
    for choice in result.choices or ():
        word = f"choice[{choice.index}]={choice.text!r}/{choice.finish_reason}"
        if choice.tool_calls:
            word += "/calls:" + ",".join(f"{call.name}({call.arguments})" for call in choice.tool_calls)
        if choice.logprobs:
            first = choice.logprobs[0]
            best = max(first.top, key=lambda t: t.logprob, default=None)
            word += f"/logprobs:{len(choice.logprobs)}"
            word += f"({first.token!r}={first.logprob:.3f}, top {best.token!r}={best.logprob:.3f})" if best else ""
        words.append(word)
    if result.embeddings is not None:
        words.append(f"embeddings={len(result.embeddings)}x{len(result.embeddings[0]) if result.embeddings else 0}")
    elif result.embedding is not None:
        words.append(f"embedding={len(result.embedding)}")
    return "".join(f" {word}" for word in words)


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
            + extras(result)
        )
    print(f"{len(seen)} results")


if __name__ == "__main__":
    main()
